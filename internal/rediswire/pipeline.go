// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package rediswire

import (
	"context"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// A pipeline sends the script calls of concurrent decisions to Redis
// together. A call that finds nothing in flight goes out at once, alone,
// as it would without a pipeline: one caller at a time pays nothing for
// batching. Calls that arrive while a call or a batch is in flight queue
// up, and go out together, in one write and one read, as soon as it
// lands; or at once, as another flight, when they make minBatch script
// calls. Each call keeps its own reply and error.
type pipeline struct {
	client     redis.UniversalClient
	scripts    *Scripts
	maxFlights int

	mu      sync.Mutex
	flights int
	queue   []*Call
	calls   int // script calls the queue makes, counting twins next to each other as one
}

// maxFlights is how many calls or batches of calls one client has in
// flight at most: enough that Redis always has a batch to read while
// this client reads the replies of one and writes the next (beyond the
// first, each waits for minBatch calls, so that concurrent decisions
// share batches). Never more than half the pool, so that other commands
// (resets, peeks) find a connection.
func maxFlights(poolSize int) int {
	return max(1, min(4, poolSize/2))
}

// minBatch is how many script calls a second flight waits for (twins
// make one): a batch worth the write, the read and the wakeups that it
// costs both sides, which are most of what a call costs when Redis is
// near.
const minBatch = 8

// run calls c's script, and returns its reply by c's deadline; c goes
// back to the pool. A queued call goes in a batch that ends by the
// earliest deadline of its calls: one timer for the batch. The calls in
// flight before it started before it, so they land by its deadline too,
// and a queued call needs no timer of its own; but a caller that waited
// for another's call before (its deadline is then earlier than those of
// the calls in flight) passes a ctx that ends by its own deadline, and
// run watches that ctx. A request whose client has gone is not sent;
// otherwise its client going does not cut a call short: its tokens may be
// taken already, and it ends by its deadline either way.
func (p *pipeline) run(ctx context.Context, c *Call) ([]any, time.Time, error) {
	if err := ctx.Err(); err != nil {
		c.free()
		return nil, time.Time{}, err
	}
	c.seal()
	p.mu.Lock()
	if p.flights == 0 {
		p.flights++
		p.mu.Unlock()
		ctx, cancel := context.WithDeadline(context.WithoutCancel(ctx), c.deadline)
		reply, err := p.alone(ctx, c)
		at := time.Now()
		cancel()
		c.free()
		p.landed()
		return reply, at, err
	}
	if len(p.queue) == 0 || !c.twin(p.queue[len(p.queue)-1]) {
		p.calls++
	}
	p.queue = append(p.queue, c)
	if p.flights < p.maxFlights && p.calls >= minBatch {
		batch := p.queue
		p.queue, p.calls = nil, 0
		p.flights++
		p.mu.Unlock()
		go p.send(batch)
	} else {
		p.mu.Unlock()
	}
	if _, ok := ctx.Deadline(); ok {
		select {
		case <-c.done:
		case <-ctx.Done():
			return nil, time.Time{}, ctx.Err() // c is the batch's until it lands: not freed
		}
	} else {
		<-c.done
	}
	reply, at, err := c.reply, c.at, c.err
	c.free()
	return reply, at, err
}

// landed ends a flight: the calls queued meanwhile go out as the next
// batch.
func (p *pipeline) landed() {
	if batch := p.next(); batch != nil {
		go p.send(batch)
	}
}

// send sends batches, as long as calls are queued, then ends its flight.
func (p *pipeline) send(batch []*Call) {
	for ; batch != nil; batch = p.next() {
		p.exec(batch)
	}
}

// next takes the calls queued as a flight's next batch, or ends the
// flight when none are.
func (p *pipeline) next() []*Call {
	p.mu.Lock()
	defer p.mu.Unlock()
	batch := p.queue
	p.queue, p.calls = nil, 0
	if len(batch) == 0 {
		p.flights--
		return nil
	}
	return batch
}

// exec sends one batch in one pipeline, by the earliest deadline of its
// calls, twins as one call, and hands each call its reply.
func (p *pipeline) exec(batch []*Call) {
	deadline := batch[0].deadline
	for _, c := range batch[1:] {
		if c.deadline.Before(deadline) {
			deadline = c.deadline
		}
	}
	ctx, cancel := context.WithDeadline(context.Background(), deadline)
	defer cancel()
	calls := batch[:0:0]
next:
	for _, c := range batch {
		for _, b := range calls {
			if c.twin(b) {
				b.twins = append(b.twins, c)
				continue next
			}
		}
		calls = append(calls, c)
	}
	cmds := p.send1(ctx, calls)
	at := time.Now()
	// Once done, a call is its caller's again: nothing here touches it
	// after.
	for i, c := range calls {
		reply, err := cmds[i].Slice()
		if len(c.twins) == 0 {
			c.reply, c.at, c.err = reply, at, err
			c.done <- struct{}{}
			continue
		}
		all := append([]*Call{c}, c.twins...)
		var replies [][]any
		if err == nil {
			replies, err = splitTwins(reply, c.costs, c.tokens, len(all))
		}
		for j, t := range all {
			if t.err, t.at = err, at; err == nil {
				t.reply = replies[j]
			}
			t.done <- struct{}{}
		}
	}
}

// alone sends one call by itself. A call that finds its script missing
// from Redis's cache (NOSCRIPT) is sent again with the script.
func (p *pipeline) alone(ctx context.Context, c *Call) ([]any, error) {
	s := p.scripts.of(c.op)
	reply, err := p.client.Do(ctx, c.command(s)...).Slice()
	if noScript(err) {
		reply, err = p.client.Do(ctx, c.evalSource(s)...).Slice()
	}
	return reply, err
}

// send1 sends calls in one pipeline. Calls that find their script missing
// from Redis's cache are sent again with the script.
func (p *pipeline) send1(ctx context.Context, calls []*Call) []*redis.Cmd {
	cmds := make([]*redis.Cmd, len(calls))
	pipe := p.client.Pipeline()
	for i, c := range calls {
		cmds[i] = pipe.Do(ctx, c.command(p.scripts.of(c.op))...)
	}
	_, _ = pipe.Exec(ctx) // each call's error is in its command
	var again []int
	for i, cmd := range cmds {
		if noScript(cmd.Err()) {
			again = append(again, i)
		}
	}
	if len(again) > 0 {
		pipe := p.client.Pipeline()
		for _, i := range again {
			c := calls[i]
			cmds[i] = pipe.Do(ctx, c.evalSource(p.scripts.of(c.op))...)
		}
		_, _ = pipe.Exec(ctx)
	}
	return cmds
}

func noScript(err error) bool { return err != nil && redis.HasErrorPrefix(err, "NOSCRIPT") }
