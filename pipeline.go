// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"context"
	"fmt"
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
	maxFlights int

	mu      sync.Mutex
	flights int
	queue   []*scriptCall
	calls   int // script calls the queue makes, counting twins next to each other as one
}

// A scriptCall is one call of the script. Calls come from a pool, and go
// back to it once their reply is read, so that a decision leaves no
// garbage of its own here: keys, arguments and the channel are reused.
type scriptCall struct {
	keys     []string
	args     []any
	alike    bool          // a take that identical calls may share (see twin)
	twins    []*scriptCall // identical calls decided with this one
	deadline time.Time
	reply    []any
	err      error
	done     chan struct{} // one value, when reply and err are in
}

var scriptCalls = sync.Pool{New: func() any { return &scriptCall{done: make(chan struct{}, 1)} }}

// newScriptCall returns an empty call, for (*pipeline).run.
func newScriptCall() *scriptCall { return scriptCalls.Get().(*scriptCall) }

// free puts c back in the pool, holding no keys, arguments or reply.
func (c *scriptCall) free() {
	clear(c.keys)
	clear(c.args)
	clear(c.twins)
	*c = scriptCall{keys: c.keys[:0], args: c.args[:0], twins: c.twins[:0], done: c.done}
	scriptCalls.Put(c)
}

// twin reports whether c is a take that b can decide with its own: the
// same keys and arguments. Such requests (a flood on one key, or a zone
// that every client shares) then cost Redis one call per batch, in which
// the script decides them one after another, each with its own reply
// (k takes, in lua/token_bucket.lua).
func (c *scriptCall) twin(b *scriptCall) bool {
	if !c.alike || !b.alike || len(c.keys) != len(b.keys) || len(c.args) != len(b.args) {
		return false
	}
	for i := range c.keys {
		if c.keys[i] != b.keys[i] {
			return false
		}
	}
	for i := range c.args {
		if c.args[i] != b.args[i] {
			return false
		}
	}
	return true
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

// run calls the script with c's keys and args, and returns its reply by
// c's deadline; c goes back to the pool. A queued call goes in a batch
// that ends by the earliest deadline of its calls: one timer for the
// batch. The calls in flight before it started before it, so they land
// by its deadline too, and a queued call needs no timer of its own; but
// a caller that waited for another's call before (its deadline is then
// earlier than those of the calls in flight) passes a ctx that ends by
// its own deadline, and run watches that ctx. A request whose client
// has gone is not sent; otherwise its client going does not cut a call
// short: its tokens may be taken already, and it ends by its deadline
// either way.
func (p *pipeline) run(ctx context.Context, c *scriptCall) ([]any, error) {
	if err := ctx.Err(); err != nil {
		c.free()
		return nil, err
	}
	p.mu.Lock()
	if p.flights == 0 {
		p.flights++
		p.mu.Unlock()
		ctx, cancel := context.WithDeadline(context.WithoutCancel(ctx), c.deadline)
		reply, err := tokenBucketScript.Run(ctx, p.client, c.keys, c.args...).Slice()
		cancel()
		c.free()
		p.landed()
		return reply, err
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
			return nil, ctx.Err() // c is the batch's until it lands: not freed
		}
	} else {
		<-c.done
	}
	reply, err := c.reply, c.err
	c.free()
	return reply, err
}

// landed ends a flight: the calls queued meanwhile go out as the next
// batch.
func (p *pipeline) landed() {
	p.mu.Lock()
	if len(p.queue) == 0 {
		p.flights--
		p.mu.Unlock()
		return
	}
	batch := p.queue
	p.queue, p.calls = nil, 0
	p.mu.Unlock()
	go p.send(batch)
}

// send sends batches, as long as calls are queued, then ends its flight.
func (p *pipeline) send(batch []*scriptCall) {
	for {
		p.exec(batch)
		p.mu.Lock()
		if len(p.queue) == 0 {
			p.flights--
			p.mu.Unlock()
			return
		}
		batch = p.queue
		p.queue, p.calls = nil, 0
		p.mu.Unlock()
	}
}

// exec sends one batch in one pipeline, by the earliest deadline of its
// calls, twins as one call. Calls that find the script missing from
// Redis's cache (NOSCRIPT, after a restart or a SCRIPT FLUSH) are sent
// again with the script.
func (p *pipeline) exec(batch []*scriptCall) {
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
	cmds := make([]*redis.Cmd, len(calls))
	pipe := p.client.Pipeline()
	for i, c := range calls {
		cmds[i] = pipe.EvalSha(ctx, tokenBucketScript.Hash(), c.keys, c.argsAll()...)
	}
	_, _ = pipe.Exec(ctx) // each call's error is in its command
	var again []int
	for i, cmd := range cmds {
		if err := cmd.Err(); err != nil && redis.HasErrorPrefix(err, "NOSCRIPT") {
			again = append(again, i)
		}
	}
	if len(again) > 0 {
		pipe := p.client.Pipeline()
		for _, i := range again {
			cmds[i] = pipe.Eval(ctx, tokenBucketLua, calls[i].keys, calls[i].argsAll()...)
		}
		_, _ = pipe.Exec(ctx)
	}
	// Once done, a call is its caller's again: nothing here touches it
	// after.
	for i, c := range calls {
		reply, err := cmds[i].Slice()
		if len(c.twins) == 0 {
			c.reply, c.err = reply, err
			c.done <- struct{}{}
			continue
		}
		all := append([]*scriptCall{c}, c.twins...)
		var replies [][]any
		if err == nil {
			replies, err = splitTakes(reply, len(c.keys), len(all))
		}
		for j, t := range all {
			if t.err = err; err == nil {
				t.reply = replies[j]
			}
			t.done <- struct{}{}
		}
	}
}

// splitTakes turns the reply of k takes of n buckets into the replies
// of the k takes, as each would have had alone (see k takes in
// lua/token_bucket.lua).
func splitTakes(v []any, n, k int) ([][]any, error) {
	if len(v) != 2*n+1 && len(v) != 2*n+2 {
		return nil, fmt.Errorf("%w: %d values for %d takes of %d buckets", errBadReply, len(v), k, n)
	}
	nums := make([]int64, 2*n+1)
	for i := range nums {
		var ok bool
		if nums[i], ok = v[i].(int64); !ok {
			return nil, fmt.Errorf("%w: %v", errBadReply, v[i])
		}
	}
	m := nums[0]
	out := make([][]any, k)
	for j := range out {
		r := make([]any, n+1, len(v)-n)
		r[0] = int64(0)
		if int64(j) < m {
			r[0] = int64(1)
		}
		for i := range n {
			debt := nums[1+i]
			if int64(j) < m {
				debt -= (m - 1 - int64(j)) * nums[1+n+i]
			}
			r[1+i] = debt
		}
		if j == 0 && len(v) == 2*n+2 {
			r = append(r, v[2*n+1]) // repaired
		}
		out[j] = r
	}
	return out, nil
}

// argsAll is the script's arguments for c and its twins: k takes for k
// calls, in place of "take".
func (c *scriptCall) argsAll() []any {
	if len(c.twins) == 0 {
		return c.args
	}
	args := make([]any, len(c.args))
	copy(args, c.args)
	args[0] = len(c.twins) + 1
	return args
}
