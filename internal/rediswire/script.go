// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package rediswire

import (
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// This file is the Go side of the scripts' protocol (lua/token_bucket.lua
// has the contract): a Call is built section by section with typed
// values, sent, and its reply read back through Reply, so that nothing
// else counts arguments or reply elements.

// Scripts are the store's scripts: the decision (take, adjust and the
// release of slots) and the read-only peek, each run with EVALSHA and
// sent again with EVAL when Redis does not have it (NOSCRIPT: after a
// restart, a SCRIPT FLUSH or an eviction of the script cache).
type Scripts struct {
	decide, peek script
}

type script struct {
	*redis.Script
	// The first two words of a command that runs it: EVALSHA and its
	// hash, or EVAL and its source; boxed once.
	evalSHA, sha, eval, src any
}

func newScript(src string) script {
	s := redis.NewScript(src)
	return script{Script: s, evalSHA: "evalsha", sha: s.Hash(), eval: "eval", src: src}
}

// NewScripts makes the scripts from their sources.
func NewScripts(decide, peek string) *Scripts {
	return &Scripts{decide: newScript(decide), peek: newScript(peek)}
}

func (s *Scripts) of(op Op) *script {
	if op == Peek {
		return &s.peek
	}
	return &s.decide
}

// An Op is what a call does.
type Op uint8

const (
	Take    Op = iota // charge every bucket, counter and slot set, or none
	Adjust            // charge each bucket and counter its own cost, refusing nothing
	Peek              // read, changing nothing
	Release           // give back the slots of one request
)

var opArgs = [...]any{Take: "take", Adjust: "adjust", Peek: "peek", Release: "release"}

// A Shape is a bucket's limit as the script reads it, its values formatted
// once: a store keeps one per limit it meets.
type Shape struct {
	Full, Cost, Ban time.Duration
	// Token is the time of one token (1/rate): the unit the script counts
	// a key's own limit (an override) and the tokens of a change of limit
	// in.
	Token time.Duration
	// Beyond is how much more than a whole bucket the bucket may owe: a
	// delay's reservations, or the debt that adjustments may run up.
	// Reserve is how much of it a take may reserve (a delay): 0 when only
	// adjustments may go there.
	Beyond, Reserve time.Duration
	// Scaled: the zone's limit comes with each request, and a bucket
	// written under another limit is read as owing the same fraction of
	// this one's.
	Scaled bool
	args   [8]any // full, cost, ban, beyond, wait (the reserve), -cost, scaled, token
}

// NewShape is the shape of a bucket that takes full to refill from empty,
// a token at a time, whose requests take cost, with a ban, or that may
// owe beyond more than a whole bucket, of which a take may reserve
// reserve (a delay).
func NewShape(full, token, cost, ban, beyond, reserve time.Duration, scaled bool) *Shape {
	s := &Shape{Full: full, Token: token, Cost: cost, Ban: ban, Beyond: beyond, Reserve: reserve, Scaled: scaled, args: [8]any{6: zero}}
	for i, d := range [6]time.Duration{full, cost, ban, beyond, reserve, -cost} {
		s.args[i] = ns(d)
	}
	s.args[7] = ns(token)
	if scaled {
		s.args[6] = "1"
	}
	return s
}

// A CounterShape is a calendar quota as the script reads it.
type CounterShape struct {
	Limit, Cost int64
	args        [3]any // limit, cost, -cost
}

func NewCounterShape(limit, cost int64) *CounterShape {
	return &CounterShape{Limit: limit, Cost: cost,
		args: [3]any{strconv.FormatInt(limit, 10), strconv.FormatInt(cost, 10), strconv.FormatInt(-cost, 10)}}
}

// A Window is a quota's calendar window by the caller's clock, with the
// windows before and after it: [b0, b1) before, [b1, b2) and [b2, b3)
// after, each boundary a whole millisecond.
type Window struct{ args [4]any }

func NewWindow(b0, b1, b2, b3 time.Time) *Window {
	var w Window
	for i, t := range [4]time.Time{b0, b1, b2, b3} {
		w.args[i] = strconv.FormatInt(t.UnixMilli()*1000, 10)
	}
	return &w
}

// A SlotShape is a zone's slots as the script reads them.
type SlotShape struct {
	Limit int64
	Lease time.Duration
	Soft  bool
	args  [3]any // limit, lease, soft
}

// NewSlotShape is a set of limit slots whose leases last lease; a soft
// set that is full does not refuse a request.
func NewSlotShape(limit int64, lease time.Duration, soft bool) *SlotShape {
	s := &SlotShape{Limit: limit, Lease: lease, Soft: soft, args: [3]any{strconv.FormatInt(limit, 10), ns(lease), "0"}}
	if soft {
		s.args[2] = "1"
	}
	return s
}

var zero any = "0"

// counts are the counts a call sends (of keys, of a section), boxed once.
var counts = func() (n [64]any) {
	for i := range n {
		n[i] = strconv.Itoa(i)
	}
	return n
}()

func ns(d time.Duration) string { return strconv.FormatInt(int64(d), 10) }

// A Call is one call of a script: an op, then its buckets, counters and
// slot sets, added in that order. Calls come from a pool and go back to
// it once their reply is read (see (*Client).Run), so that a decision
// leaves no garbage of its own: keys, arguments, the command made of
// them and the channel are reused.
type Call struct {
	op         Op
	keys       []string
	args       []any
	cmd        []any           // what is sent: see command
	costs      []time.Duration // each bucket's cost, for twins' replies
	tokens     []time.Duration // and its shape's token
	nb, nc, ns int
	alike      bool // a take of buckets without ban or delay (see twin)
	deadline   time.Time

	// The pipeline's: the identical calls decided with this one, and the
	// reply.
	twins []*Call
	reply []any
	at    time.Time // when the reply came in
	err   error
	done  chan struct{} // one value, when reply and err are in
}

var calls = sync.Pool{New: func() any { return &Call{done: make(chan struct{}, 1)} }}

// NewCall is an empty call of op that must be answered by deadline.
func NewCall(op Op, deadline time.Time) *Call {
	c := calls.Get().(*Call)
	c.op, c.deadline, c.alike = op, deadline, op == Take
	c.args = append(c.args, opArgs[op])
	if op != Release {
		c.args = append(c.args, "", nil, nil, nil)
	}
	return c
}

// free puts c back in the pool, holding no keys, arguments or reply.
func (c *Call) free() {
	clear(c.keys)
	clear(c.args)
	clear(c.cmd)
	clear(c.twins)
	*c = Call{keys: c.keys[:0], args: c.args[:0], cmd: c.cmd[:0], costs: c.costs[:0], tokens: c.tokens[:0], twins: c.twins[:0], done: c.done}
	calls.Put(c)
}

// Clock replaces Redis's clock with t for this call. Only tests set it,
// to replay a table of instants.
func (c *Call) Clock(t time.Time) { c.args[1] = strconv.FormatInt(t.UnixMicro(), 10) }

// Bucket asks for s.Cost from the bucket field of hash, whose key's own
// limit (an override) would be the key limit; the request may wait for
// its tokens up to s.Reserve, or, without wait, not at all.
func (c *Call) Bucket(hash, field, limit string, s *Shape, wait bool) {
	w := zero
	if wait {
		w = s.args[4]
	}
	c.bucket(hash, field, limit, s, s.Cost, s.args[1], w)
}

// AdjustBucket charges the bucket cost more, or gives -cost back.
func (c *Call) AdjustBucket(hash, field, limit string, s *Shape, cost time.Duration) {
	c.bucket(hash, field, limit, s, cost, costArg(int64(cost), int64(s.Cost), s.args[1], s.args[5]), zero)
}

// costArg is the argument of an adjustment by cost, for a shape whose own
// cost is own, formatted once as pos and its negation as neg.
func costArg(cost, own int64, pos, neg any) any {
	switch cost {
	case own:
		return pos
	case -own:
		return neg
	}
	return strconv.FormatInt(cost, 10)
}

func (c *Call) bucket(hash, field, limit string, s *Shape, cost time.Duration, costArg, wait any) {
	if c.nc+c.ns > 0 {
		panic("rediswire: buckets go before counters and slots")
	}
	c.keys = append(c.keys, hash, limit)
	c.args = append(c.args, field, s.args[0], costArg, s.args[2], s.args[3], wait, s.args[6], s.args[7])
	c.costs = append(c.costs, cost)
	c.tokens = append(c.tokens, s.Token)
	c.alike = c.alike && s.Ban == 0 && s.Beyond == 0
	c.nb++
}

// Counter asks for s.Cost units of the quota counter key in window w.
// untagged is the key an earlier build kept it in (see CounterZone), read
// while key is absent.
func (c *Call) Counter(key, untagged string, s *CounterShape, w *Window) {
	c.counter(key, untagged, s, w, s.args[1])
}

// AdjustCounter counts cost units more in the counter, or takes -cost
// off.
func (c *Call) AdjustCounter(key, untagged string, s *CounterShape, w *Window, cost int64) {
	c.counter(key, untagged, s, w, costArg(cost, s.Cost, s.args[1], s.args[2]))
}

func (c *Call) counter(key, untagged string, s *CounterShape, w *Window, costArg any) {
	if c.ns > 0 {
		panic("rediswire: counters go before slots")
	}
	c.keys = append(c.keys, key, untagged)
	c.args = append(c.args, s.args[0], costArg, w.args[0], w.args[1], w.args[2], w.args[3])
	c.alike = false
	c.nc++
}

// Slot asks for a slot of the set key for the request id, the same for
// every slot of a call. A Release call needs only key and id.
func (c *Call) Slot(key, id string, s *SlotShape) {
	c.keys = append(c.keys, key)
	if c.ns == 0 {
		c.args = append(c.args, id)
	}
	if c.op != Release {
		c.args = append(c.args, s.args[0], s.args[1], s.args[2])
	}
	c.alike = false
	c.ns++
}

// seal writes the sections' counts into the header.
func (c *Call) seal() {
	if c.op != Release {
		c.args[2], c.args[3], c.args[4] = count(c.nb), count(c.nc), count(c.ns)
	}
}

// command makes the command that runs s with c's keys and arguments, for
// c and its twins (k takes for k calls, in place of "take"), in c's own
// slice: go-redis sends it as it is, with nothing copied or boxed again.
// The twins of a call send nothing of their own.
func (c *Call) command(s *script) []any {
	c.cmd = append(c.cmd[:0], s.evalSHA, s.sha, count(len(c.keys)))
	for i, k := range c.keys {
		if i > 0 && k == c.keys[i-1] {
			c.cmd = append(c.cmd, c.cmd[len(c.cmd)-1]) // a bucket's hash, again for its override: boxed once
		} else {
			c.cmd = append(c.cmd, k)
		}
	}
	c.cmd = append(c.cmd, c.args...)
	if len(c.twins) > 0 {
		c.cmd[3+len(c.keys)] = count(len(c.twins) + 1)
	}
	return c.cmd
}

// count is n as an argument.
func count(n int) any {
	if n < len(counts) {
		return counts[n]
	}
	return strconv.Itoa(n)
}

// evalSource turns c's command into one that sends s's source (EVAL), for
// a Redis that does not have the script.
func (c *Call) evalSource(s *script) []any {
	c.cmd[0], c.cmd[1] = s.eval, s.src
	return c.cmd
}

// twin reports whether c is a take that b can decide with its own: the
// same keys and arguments. Such requests (a flood on one key, or a zone
// that every client shares) then cost Redis one call per batch, in which
// the script decides them one after another (k takes).
func (c *Call) twin(b *Call) bool {
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

// A Reply is a call's answer, in the layout lua/token_bucket.lua gives.
type Reply struct {
	v          []any
	nb, nc, ns int
	at         time.Time
}

// reply checks v, the answer to a call with nb buckets, nc counters and
// ns slot sets.
func reply(v []any, nb, nc, ns int) (Reply, error) {
	if len(v) != 3+4*nb+2*(nc+ns) {
		return Reply{}, fmt.Errorf("%w: %d values for %d buckets, %d counters and %d slot sets", ErrBadReply, len(v), nb, nc, ns)
	}
	for _, x := range v {
		if _, ok := x.(int64); !ok {
			return Reply{}, fmt.Errorf("%w: %v", ErrBadReply, x)
		}
	}
	return Reply{v: v, nb: nb, nc: nc, ns: ns}, nil
}

func (r Reply) int(i int) int64 { return r.v[i].(int64) }

// At is the instant the reply came in: Redis decided before it.
func (r Reply) At() time.Time { return r.at }

// Clock is the instant, on Redis's clock, that the call was decided at.
func (r Reply) Clock() time.Time { return time.UnixMicro(r.int(len(r.v) - 1)) }

// Allowed reports whether the take was allowed.
func (r Reply) Allowed() bool { return r.int(0) == 1 }

// Repaired is how many keys of another type the call found.
func (r Reply) Repaired() int64 { return r.int(1) }

// Bucket is what the i-th bucket owes after the call, and whether the
// call started its ban.
func (r Reply) Bucket(i int) (debt time.Duration, banStarted bool) {
	return time.Duration(r.int(2 + 4*i)), r.int(3+4*i) == 1
}

// Override is the key's own limit that decided the i-th bucket: its
// token's time and its burst; 0, 0 when the shape sent decided.
func (r Reply) Override(i int) (token time.Duration, burst int64) {
	return time.Duration(r.int(4 + 4*i)), r.int(5 + 4*i)
}

// Counter is the j-th counter's count after the call, and how long until
// its window ends.
func (r Reply) Counter(j int) (used int64, left time.Duration) {
	k := 2 + 4*r.nb + 2*j
	return r.int(k), time.Duration(r.int(k + 1))
}

// Slot reports whether the request holds a slot of the j-th set, and how
// many of its slots are free.
func (r Reply) Slot(j int) (held bool, free int64) {
	k := 2 + 4*r.nb + 2*(r.nc+j)
	return r.int(k) == 1, r.int(k + 1)
}

// splitTwins turns the reply of k takes of nb buckets into the replies of
// the k takes, as each would have had alone: the j-th of m allowed owes
// debt - (m-1-j) cost, the cost of a bucket that its key's own limit
// decided counted in that limit's tokens (tokens are the shapes'). The
// keys found of another type count in the first's.
func splitTwins(v []any, costs, tokens []time.Duration, k int) ([][]any, error) {
	r, err := reply(v, len(costs), 0, 0)
	if err != nil {
		return nil, err
	}
	m := r.int(0)
	out := make([][]any, k)
	for j := range out {
		t := make([]any, len(v))
		t[0], t[1] = int64(0), int64(0)
		if int64(j) < m {
			t[0] = int64(1)
		}
		if j == 0 {
			t[1] = v[1]
		}
		for i, cost := range costs {
			debt := r.int(2 + 4*i)
			if tok, _ := r.Override(i); tok > 0 {
				cost = cost / tokens[i] * tok
			}
			if int64(j) < m {
				debt -= (m - 1 - int64(j)) * int64(cost)
			}
			t[2+4*i], t[3+4*i], t[4+4*i], t[5+4*i] = debt, int64(0), v[4+4*i], v[5+4*i]
		}
		t[len(t)-1] = v[len(v)-1] // the clock
		out[j] = t
	}
	return out, nil
}
