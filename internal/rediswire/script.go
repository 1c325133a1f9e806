// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package rediswire

import (
	"errors"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// This file is the Go side of the scripts' protocol (lua/decide/10_call.lua
// has the contract): a Call is one request's decision, built section by
// section with typed values; the pipeline sends the calls of a flight as
// one script call (a command), and each call's part of the reply is read
// back through Reply, so that nothing else counts arguments or reply
// elements.

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
	Share             // touch a bucket of a zone with share: a cost, a report, a grant, a return (see Call.Share)
)

var opArgs = [...]any{Take: "take", Adjust: "adjust", Peek: "peek", Release: "release", Share: "share"}

// noClock is the clock argument that has the script read Redis's.
var noClock any = ""

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
	// adjustments may go there; negative for a zone with reserves, the
	// part of the whole bucket a take must leave to the classes above
	// its request's (gcra.Limit.Kept).
	Beyond, Reserve time.Duration
	// Scaled: the zone's limit comes with each request, and a bucket
	// written under another limit is read as owing the same fraction of
	// this one's.
	Scaled bool
	// plain: no ban, beyond or scale, so that a take of it alone is a
	// plain decision (see Call); lean: no ban or scale, so that an
	// adjustment of it alone is one.
	plain, lean bool
	args        [8]any // full, cost, ban, beyond, wait (the reserve), -cost, scaled, token
	plainToken  any    // token as a plain shape sends it: negative for a zone with share
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
	s.plainToken = s.args[7]
	s.lean = ban == 0 && !scaled
	s.plain = s.lean && beyond == 0 && reserve == 0
	if scaled {
		s.args[6] = "1"
	}
	return s
}

// NewSharedShape is the shape of a bucket of a zone with share, as
// NewShape's: a plain take of it owes at least what the shares out hold
// (lua/decide/20_buckets.lua).
func NewSharedShape(full, token, cost time.Duration) *Shape {
	s := NewShape(full, token, cost, 0, 0, 0, false)
	s.plainToken = ns(-token)
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
	s := &SlotShape{Limit: limit, Lease: lease, Soft: soft, args: [3]any{strconv.FormatInt(limit, 10), ns(lease), flagArg(soft)}}
	return s
}

var zero, one any = "0", "1"

// counts are the counts a call sends (of keys, of a section), boxed once.
var counts = func() (n [64]any) {
	for i := range n {
		n[i] = strconv.Itoa(i)
	}
	return n
}()

func ns(d time.Duration) string { return strconv.FormatInt(int64(d), 10) }

// count is n as an argument.
func count(n int) any {
	if n < len(counts) {
		return counts[n]
	}
	return strconv.Itoa(n)
}

// A Call is one request's decision: an op, then its buckets, counters and
// slot sets, added in that order. Calls come from a pool and go back to
// it once their reply is read (see (*Client).Run), so that a decision
// leaves no garbage of its own.
//
// A take whose buckets are all plain (their shapes have no ban, beyond
// or scale, and no override is read) and that has no counters or slots
// is sent as a plain decision: each bucket its hash, its field and the
// index of its shape, which the command sends once. So is an adjustment
// of buckets of one shape without ban or scale, whose beyond it sends
// once, and each bucket's cost.
type Call struct {
	op       Op
	buckets  []bucketArgs
	counters []counterArgs
	slots    []slotArgs
	share    shareArgs
	id       string // the request's, for its slots
	plain    bool
	clock    any
	deadline time.Time

	// The pipeline's: the call's results in its command's reply, and
	// what the reply says of the whole command.
	reply    []any
	at       time.Time // when the reply came in
	clockAt  int64
	repaired int64
	err      error
	done     chan struct{} // one value, when reply and err are in
}

type bucketArgs struct {
	hash, field, limit string
	shape              *Shape
	cost, wait, soft   any
}

type counterArgs struct {
	key, untagged string
	shape         *CounterShape
	window        *Window
	cost, soft    any
}

type slotArgs struct {
	key   string
	shape *SlotShape
}

type shareArgs struct {
	hash                                           string
	field, full, token, cost, holder, known, spent any
	want, ttl, ret                                 any
}

var calls = sync.Pool{New: func() any { return &Call{done: make(chan struct{}, 1)} }}

// NewCall is an empty call of op that must be answered by deadline.
func NewCall(op Op, deadline time.Time) *Call {
	c := calls.Get().(*Call)
	c.op, c.deadline, c.plain, c.clock = op, deadline, op == Take || op == Adjust, noClock
	return c
}

// free puts c back in the pool, holding no keys, arguments or reply.
func (c *Call) free() {
	clear(c.buckets)
	clear(c.counters)
	clear(c.slots)
	*c = Call{buckets: c.buckets[:0], counters: c.counters[:0], slots: c.slots[:0], done: c.done}
	calls.Put(c)
}

// Clock replaces Redis's clock with t for this call. Only tests set it,
// to replay a table of instants; calls of different clocks go to Redis
// apart.
func (c *Call) Clock(t time.Time) { c.clock = strconv.FormatInt(t.UnixMicro(), 10) }

// Bucket asks for s.Cost from the bucket field of hash, whose key's own
// limit (an override) would be the key limit, or none when limit is hash;
// the request may wait for its tokens up to s.Reserve, or, without wait,
// not at all. A soft bucket that lacks the tokens refuses nothing, and is
// charged nothing (see Reply.BucketShort).
func (c *Call) Bucket(hash, field, limit string, s *Shape, wait, soft bool) {
	w := zero
	if wait {
		w = s.args[4]
	}
	c.bucket(bucketArgs{hash, field, limit, s, s.args[1], w, flagArg(soft)})
}

// flagArg is the script's argument of a flag.
func flagArg(on bool) any {
	if on {
		return one
	}
	return zero
}

// AdjustBucket charges the bucket cost more, or gives -cost back.
func (c *Call) AdjustBucket(hash, field, limit string, s *Shape, cost time.Duration) {
	c.bucket(bucketArgs{hash, field, limit, s, costArg(int64(cost), int64(s.Cost), s.args[1], s.args[5]), zero, zero})
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

func (c *Call) bucket(b bucketArgs) {
	if len(c.counters)+len(c.slots) > 0 {
		panic("rediswire: buckets go before counters and slots")
	}
	plain := b.shape.plain
	if c.op == Adjust {
		plain = b.shape.lean && (len(c.buckets) == 0 || c.buckets[0].shape == b.shape)
	}
	c.plain = c.plain && plain && b.limit == b.hash && b.soft == zero
	c.buckets = append(c.buckets, b)
}

// Counter asks for s.Cost units of the quota counter key in window w.
// untagged is the key an earlier build kept it in (see CounterZone), read
// while key is absent. A soft counter that lacks the units refuses
// nothing, and counts nothing (see Reply.CounterShort).
func (c *Call) Counter(key, untagged string, s *CounterShape, w *Window, soft bool) {
	c.counter(counterArgs{key, untagged, s, w, s.args[1], flagArg(soft)})
}

// AdjustCounter counts cost units more in the counter, or takes -cost
// off.
func (c *Call) AdjustCounter(key, untagged string, s *CounterShape, w *Window, cost int64) {
	c.counter(counterArgs{key, untagged, s, w, costArg(cost, s.Cost, s.args[1], s.args[2]), zero})
}

func (c *Call) counter(k counterArgs) {
	if len(c.slots) > 0 {
		panic("rediswire: counters go before slots")
	}
	c.counters = append(c.counters, k)
	c.plain = false
}

// Slot asks for a slot of the set key for the request id, the same for
// every slot of a call. A Release call needs only key and id.
func (c *Call) Slot(key, id string, s *SlotShape) {
	c.slots = append(c.slots, slotArgs{key, s})
	c.id = id
	c.plain = false
}

// Share touches a bucket of a zone with share, of plain shape s, for
// the holder's share of it (lua/decide/65_share.lua has the protocol):
// it takes cost (negative: gives it back), reports that the holder spent
// spent of what it was granted, knowing known, and asks want more, for
// ttl from now; or, with ret, gives back what the holder did not spend.
// The call holds nothing else.
func (c *Call) Share(hash, field string, s *Shape, cost time.Duration, holder string, known, spent, want, ttl time.Duration, ret bool) {
	if len(c.buckets)+len(c.counters)+len(c.slots) > 0 || c.op != Share {
		panic("rediswire: a share call holds its one bucket alone")
	}
	a := &s.args
	c.share = shareArgs{hash, field, a[0], a[7], costArg(int64(cost), int64(s.Cost), a[1], a[5]), holder,
		ns(known), ns(spent), ns(want), ns(ttl), flagArg(ret)}
}

// results is how many values the call's part of the reply holds.
func (c *Call) results() int {
	switch {
	case c.plain:
		return 1 + len(c.buckets)
	case c.op == Release:
		return 1
	case c.op == Share:
		return 5
	}
	return 1 + 4*len(c.buckets) + 3*len(c.counters) + 2*len(c.slots)
}

// keys appends the call's keys to cmd.
func (c *Call) keys(cmd []any) []any {
	if c.op == Share {
		return append(cmd, c.share.hash)
	}
	for i := range c.buckets {
		b := &c.buckets[i]
		cmd = append(cmd, b.hash)
		if !c.plain {
			if b.limit == b.hash {
				cmd = append(cmd, cmd[len(cmd)-1]) // boxed once
			} else {
				cmd = append(cmd, b.limit)
			}
		}
	}
	for i := range c.counters {
		cmd = append(cmd, c.counters[i].key, c.counters[i].untagged)
	}
	for i := range c.slots {
		cmd = append(cmd, c.slots[i].key)
	}
	return cmd
}

// args appends the call's decision to cmd: plain, with its shapes' places
// in shapes, or in sections.
func (c *Call) args(cmd []any, shapes []*Shape) []any {
	if c.plain && c.op == Adjust && len(c.buckets) > 0 {
		a := &c.buckets[0].shape.args
		cmd = append(cmd, adjustArg, count(len(c.buckets)), count(1+slices.Index(shapes, c.buckets[0].shape)), a[3])
		for i := range c.buckets {
			cmd = append(cmd, c.buckets[i].field, c.buckets[i].cost)
		}
		return cmd
	}
	if c.plain {
		cmd = append(cmd, count(len(c.buckets)))
		for i := range c.buckets {
			b := &c.buckets[i]
			cmd = append(cmd, count(1+slices.Index(shapes, b.shape)), b.field)
		}
		return cmd
	}
	if c.op == Release {
		return append(cmd, opArgs[Release], count(len(c.slots)), c.id)
	}
	if c.op == Share {
		a := &c.share
		return append(cmd, opArgs[Share], a.field, a.full, a.token, a.cost, a.holder, a.known, a.spent, a.want, a.ttl, a.ret)
	}
	cmd = append(cmd, opArgs[c.op], count(len(c.buckets)), count(len(c.counters)), count(len(c.slots)))
	for i := range c.buckets {
		b := &c.buckets[i]
		a := &b.shape.args
		cmd = append(cmd, b.field, a[0], b.cost, a[2], a[3], b.wait, a[6], a[7], b.soft)
	}
	for i := range c.counters {
		k := &c.counters[i]
		cmd = append(cmd, k.shape.args[0], k.cost, k.window.args[0], k.window.args[1], k.window.args[2], k.window.args[3], k.soft)
	}
	if len(c.slots) > 0 {
		cmd = append(cmd, c.id)
		for i := range c.slots {
			a := &c.slots[i].shape.args
			cmd = append(cmd, a[0], a[1], a[2])
		}
	}
	return cmd
}

// A command is one script call that decides calls, in order: what a
// flight sends for them. Its slices are reused from flight to flight.
type command struct {
	script *script
	calls  []*Call
	cmd    []any
	shapes []*Shape // the plain shapes its calls use
}

// build makes the command that runs the script for the calls, in its own
// slice: go-redis sends it as it is, with nothing copied or boxed again.
// The calls share its clock (tests set it per call; such calls are not
// put together).
func (m *command) build() []any {
	s := m.script
	m.cmd = append(m.cmd[:0], s.evalSHA, s.sha, nil)
	m.shapes = m.shapes[:0]
	others := 0 // decisions that are not plain takes: the script makes their functions only if any
	for i := 0; i < len(m.calls); i += run(m.calls[i:]) {
		c := m.calls[i]
		m.cmd = c.keys(m.cmd)
		if !c.plain || c.op != Take {
			others++
		}
		if !c.plain {
			continue
		}
		for i := range c.buckets {
			if sh := c.buckets[i].shape; !slices.Contains(m.shapes, sh) {
				m.shapes = append(m.shapes, sh)
			}
		}
	}
	m.cmd[2] = count(len(m.cmd) - 3)
	m.cmd = append(m.cmd, m.calls[0].clock, count(others), count(len(m.shapes)))
	for _, sh := range m.shapes {
		m.cmd = append(m.cmd, sh.args[0], sh.args[1], sh.plainToken)
	}
	for i := 0; i < len(m.calls); {
		n := run(m.calls[i:])
		if n > 1 {
			b := &m.calls[i].buckets[0]
			m.cmd = append(m.cmd, runArg, count(n), count(1+slices.Index(m.shapes, b.shape)), b.field)
		} else {
			m.cmd = m.calls[i].args(m.cmd, m.shapes)
		}
		i += n
	}
	return m.cmd
}

// runArg is the op of a run of plain takes of one bucket, adjustArg
// that of a plain adjustment.
var runArg, adjustArg any = "*", "+"

// run is how many of calls, from the first, are plain takes of the same
// one bucket: a flood of one key. They go as one decision, a run, whose
// key and field are sent once; each take still has its own result.
func run(calls []*Call) int {
	c := calls[0]
	if !c.plain || c.op != Take || len(c.buckets) != 1 {
		return 1
	}
	b := &c.buckets[0]
	n := 1
	for n < len(calls) {
		d := calls[n]
		if !d.plain || d.op != Take || len(d.buckets) != 1 || d.buckets[0].shape != b.shape || d.buckets[0].hash != b.hash || d.buckets[0].field != b.field {
			break
		}
		n++
	}
	return n
}

// evalSource turns the command into one that sends the script's source
// (EVAL), for a Redis that does not have it.
func (m *command) evalSource() []any {
	m.cmd[0], m.cmd[1] = m.script.eval, m.script.src
	return m.cmd
}

// reset lets go of the calls and the arguments, for the command's next
// use.
func (m *command) reset() {
	clear(m.calls)
	clear(m.cmd)
	clear(m.shapes)
	m.calls, m.cmd, m.shapes = m.calls[:0], m.cmd[:0], m.shapes[:0]
}

// answer hands each call its part of v, the command's reply, or err.
// at is when the reply came in. Once done, a call is its caller's again:
// nothing here touches it after.
func (m *command) answer(v []any, err error, at time.Time) {
	var clock, repaired int64
	err = sentAndLost(err)
	if err == nil {
		clock, repaired, err = m.check(v)
	}
	off := 2
	for i, c := range m.calls {
		c.at, c.err = at, err
		if err == nil {
			n := c.results()
			c.reply, c.clockAt = v[off:off+n], clock
			if i == 0 {
				c.repaired = repaired
			}
			off += n
		}
		c.done <- struct{}{}
	}
}

// check reads the head of a reply, and checks that it holds the results
// of every call, as numbers.
func (m *command) check(v []any) (clock, repaired int64, err error) {
	n := 2
	for _, c := range m.calls {
		n += c.results()
	}
	if len(v) != n {
		return 0, 0, fmt.Errorf("%w: %d values for %d calls", ErrBadReply, len(v), len(m.calls))
	}
	for _, x := range v {
		if _, ok := x.(int64); !ok {
			return 0, 0, fmt.Errorf("%w: %v", ErrBadReply, x)
		}
	}
	return v[0].(int64), v[1].(int64), nil
}

// A Reply is a call's answer, in the layout lua/decide/10_call.lua gives.
type Reply struct {
	v          []any
	plain      bool
	nb, nc, ns int
	clock      int64
	repaired   int64
	at         time.Time
}

// answer is c's reply, or its error: the command's, or when Redis's clock is outside the quota
// windows c sent.
func (c *Call) answer() (Reply, error) {
	if c.err != nil {
		return Reply{}, c.err
	}
	r := Reply{v: c.reply, plain: c.plain, nb: len(c.buckets), nc: len(c.counters), ns: len(c.slots),
		clock: c.clockAt, repaired: c.repaired, at: c.at}
	if c.op != Release && r.int(0) < 0 {
		return Reply{}, ErrWindow
	}
	return r, nil
}

// ErrWindow is a decision whose quota windows, by this instance's clock,
// do not hold Redis's: the clocks are more than a window apart. Redis
// answered, so it says nothing of Redis's health.
var ErrWindow = errors.New("quota window: Redis TIME is outside the windows Caddy sent (clocks more than a window apart)")

func (r Reply) int(i int) int64 { return r.v[i].(int64) }

// At is the instant the reply came in: Redis decided before it.
func (r Reply) At() time.Time { return r.at }

// Clock is the instant, on Redis's clock, that the call was decided at.
func (r Reply) Clock() time.Time { return time.UnixMicro(r.clock) }

// Allowed reports whether the take was allowed.
func (r Reply) Allowed() bool { return r.int(0) == 1 }

// Repaired is how many keys of another type the call found (the first
// call of a command reports the command's).
func (r Reply) Repaired() int64 { return r.repaired }

// Bucket is what the i-th bucket owes after the call, and whether the
// call started its ban.
func (r Reply) Bucket(i int) (debt time.Duration, banStarted bool) {
	if r.plain {
		return time.Duration(r.int(1 + i)), false
	}
	return time.Duration(r.int(1 + 4*i)), r.int(2+4*i)&1 == 1
}

// BucketShort reports whether the i-th bucket, soft, lacked the tokens:
// the call charged it nothing.
func (r Reply) BucketShort(i int) bool { return !r.plain && r.int(2+4*i)&2 != 0 }

// Override is the key's own limit that decided the i-th bucket: its
// token's time and its burst; 0, 0 when the shape sent decided.
func (r Reply) Override(i int) (token time.Duration, burst int64) {
	if r.plain {
		return 0, 0
	}
	return time.Duration(r.int(3 + 4*i)), r.int(4 + 4*i)
}

// Counter is the j-th counter's count after the call, and how long until
// its window ends.
func (r Reply) Counter(j int) (used int64, left time.Duration) {
	k := 1 + 4*r.nb + 3*j
	return r.int(k), time.Duration(r.int(k + 1))
}

// CounterShort reports whether the j-th counter, soft, lacked the units:
// the call counted nothing in it.
func (r Reply) CounterShort(j int) bool { return r.int(1+4*r.nb+3*j+2) == 1 }

// Share is a share call's answer: whether the bucket had the cost, what
// it owes after the call, the tokens granted to the holder so far (0: it
// holds no share), how long its share lasts in Redis, and the tokens out
// in all the holders' shares, not reported spent. Every amount is a
// duration of refill.
func (r Reply) Share() (allowed bool, debt, granted, left, out time.Duration) {
	return r.int(0) == 1, time.Duration(r.int(1)), time.Duration(r.int(2)), time.Duration(r.int(3)), time.Duration(r.int(4))
}

// Slot reports whether the request holds a slot of the j-th set, and how
// many of its slots are free.
func (r Reply) Slot(j int) (held bool, free int64) {
	k := 1 + 4*r.nb + 3*r.nc + 2*j
	return r.int(k) == 1, r.int(k + 1)
}
