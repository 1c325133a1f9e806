// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package rediswire

import (
	"context"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// A pipeline sends the calls of concurrent decisions to Redis together,
// as one script call: a flight. A call that finds nothing in flight goes
// out at once, alone, as it would without a pipeline: one caller at a
// time pays nothing for batching. Calls that arrive while a flight is out
// queue up, and go out together as soon as it lands; or at once, as
// another flight, when they are minBatch. The script decides a flight's
// calls one after another, each all or nothing for its own demands, and
// each call keeps its own reply and error.
//
// The unit of cost is the command, not the decision: go-redis builds and
// parses each command, and Redis dispatches each and sets up its script.
// So a flight is one command on one Redis; on a Redis Cluster, one per
// hash tag among its calls (their keys share a tag, so a slot), sent in
// one pipeline that go-redis splits among the masters. Peeks run a
// script of their own, a command each.
type pipeline struct {
	client     redis.UniversalClient
	scripts    *Scripts
	cluster    bool
	maxFlights int

	mu      sync.Mutex
	flights int
	queue   []*Call
}

// maxFlights is how many flights one client has out at most: enough that
// Redis always has a command to run while this client reads the reply
// of one and writes the next (beyond the first, each waits for minBatch
// calls, so that concurrent decisions share flights). Never more than
// half the pool, so that other commands (resets, overrides) find a
// connection.
func maxFlights(poolSize int) int {
	return max(1, min(4, poolSize/2))
}

// minBatch is how many calls a second flight waits for: a flight worth
// the write, the read and the wakeups that it costs both sides, which
// are most of what a decision costs when Redis is near.
const minBatch = 8

// run calls c's script, and returns its reply by c's deadline; c goes
// back to the pool. A queued call goes in a flight that ends by the
// earliest deadline of its calls: one timer for the flight. The flights
// out before it started before it, so they land by its deadline too, and
// a queued call needs no timer of its own; but a caller that waited for
// another's call before (its deadline is then earlier than those of the
// calls in flight) passes a ctx that ends by its own deadline, and run
// watches that ctx. A request whose client has gone is not sent;
// otherwise its client going does not cut a call short: its tokens may be
// taken already, and it ends by its deadline either way.
func (p *pipeline) run(ctx context.Context, c *Call) (Reply, error) {
	if err := ctx.Err(); err != nil {
		c.free()
		return Reply{}, err
	}
	p.mu.Lock()
	if p.flights == 0 {
		p.flights++
		p.mu.Unlock()
		p.send([]*Call{c})
	} else {
		p.queue = append(p.queue, c)
		if p.flights < p.maxFlights && len(p.queue) >= minBatch {
			batch := p.queue
			p.queue = nil
			p.flights++
			p.mu.Unlock()
			go p.send(batch)
		} else {
			p.mu.Unlock()
		}
	}
	if _, ok := ctx.Deadline(); ok {
		select {
		case <-c.done:
		case <-ctx.Done():
			// c is the flight's until it lands: not freed, and it may
			// yet be sent.
			return Reply{}, unanswered{ctx.Err()}
		}
	} else {
		<-c.done
	}
	r, err := c.answer()
	c.free()
	return r, err
}

// send sends flights, as long as calls are queued, then ends its own.
// The first flight of a call that was alone is sent from its caller's
// goroutine; the calls queued meanwhile go out from another.
func (p *pipeline) send(batch []*Call) {
	p.fly(batch)
	if batch = p.next(); batch != nil {
		go func() {
			for ; batch != nil; batch = p.next() {
				p.fly(batch)
			}
		}()
	}
}

// next takes the calls queued as a flight's next batch, or ends the
// flight when none are.
func (p *pipeline) next() []*Call {
	p.mu.Lock()
	defer p.mu.Unlock()
	batch := p.queue
	p.queue = nil
	if len(batch) == 0 {
		p.flights--
		return nil
	}
	return batch
}

// commands are reused from flight to flight.
var commands = sync.Pool{New: func() any { return new(command) }}

// fly sends one flight by the earliest deadline of its calls, and hands
// each call its reply.
func (p *pipeline) fly(batch []*Call) {
	deadline := batch[0].deadline
	for _, c := range batch[1:] {
		if c.deadline.Before(deadline) {
			deadline = c.deadline
		}
	}
	ctx, cancel := context.WithDeadline(context.Background(), deadline)
	defer cancel()
	cmds := p.commands(batch)
	if len(cmds) == 1 {
		m := cmds[0]
		v, err := p.client.Do(ctx, m.build()...).Slice()
		if noScript(err) {
			v, err = p.client.Do(ctx, m.evalSource()...).Slice()
		}
		m.answer(v, err, time.Now())
	} else {
		p.pipelined(ctx, cmds)
	}
	for _, m := range cmds {
		m.reset()
		commands.Put(m)
	}
}

// commands groups a flight's calls into commands: the decisions in one
// (one per hash tag on a cluster, and per clock a test sets), each peek
// in its own.
func (p *pipeline) commands(batch []*Call) []*command {
	var cmds []*command
	var decide []*command // the commands of the decision script
next:
	for _, c := range batch {
		if c.op != Peek {
			for _, m := range decide {
				if c.clock == m.calls[0].clock && (!p.cluster || tag(c) == tag(m.calls[0])) {
					m.calls = append(m.calls, c)
					continue next
				}
			}
		}
		m := commands.Get().(*command)
		m.script = p.scripts.of(c.op)
		m.calls = append(m.calls, c)
		cmds = append(cmds, m)
		if c.op != Peek {
			decide = append(decide, m)
		}
	}
	return cmds
}

// tag is the hash tag of c's keys, which they share.
func tag(c *Call) string {
	var key string
	switch {
	case c.op == Share:
		key = c.share.hash
	case len(c.buckets) > 0:
		key = c.buckets[0].hash
	case len(c.counters) > 0:
		key = c.counters[0].key
	case len(c.slots) > 0:
		key = c.slots[0].key
	}
	i := strings.IndexByte(key, '{')
	if i < 0 {
		return key
	}
	j := strings.IndexByte(key[i+1:], '}')
	if j < 0 {
		return key
	}
	return key[i+1 : i+1+j]
}

// pipelined sends commands in one pipeline. Those that find their script
// missing from Redis's cache are sent again with the script.
func (p *pipeline) pipelined(ctx context.Context, cmds []*command) {
	sent := make([]*redis.Cmd, len(cmds))
	pipe := p.client.Pipeline()
	for i, m := range cmds {
		sent[i] = pipe.Do(ctx, m.build()...)
	}
	_, _ = pipe.Exec(ctx) // each command's error is its own
	var again []int
	for i, cmd := range sent {
		if noScript(cmd.Err()) {
			again = append(again, i)
		}
	}
	if len(again) > 0 {
		pipe := p.client.Pipeline()
		for _, i := range again {
			sent[i] = pipe.Do(ctx, cmds[i].evalSource()...)
		}
		_, _ = pipe.Exec(ctx)
	}
	at := time.Now()
	for i, m := range cmds {
		v, err := sent[i].Slice()
		m.answer(v, err, at)
	}
}

func noScript(err error) bool { return err != nil && redis.HasErrorPrefix(err, "NOSCRIPT") }
