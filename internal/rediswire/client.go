// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

// Package rediswire is the Redis store's side of the wire: the scripts'
// protocol (a typed call and its reply), the pipeline that carries
// concurrent calls together, the client's health (a circuit breaker, the
// round trip, outages logged once), the names of the keys and what a
// failed call says of Redis. It knows nothing of HTTP, zones or the
// bucket math: the store (internal/redisstore) says what to ask.
package rediswire

import (
	"cmp"
	"context"
	"fmt"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/throttle"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
)

// A Client is a connection pool to one Redis setup, with its health.
// Stores that share a setup share a Client.
type Client struct {
	redis.UniversalClient
	Cluster bool // a Redis Cluster: keys in different slots need calls of their own
	// breaker is the store's: on a cluster, of all its masters together
	// (see Answered and probe).
	breaker breaker
	cluster *redis.ClusterClient // the client, on a cluster
	pipe    *pipeline
	scripts *Scripts
	closed  chan struct{} // closed by Destruct: probes stop
	// Each outage is logged when it starts and when it ends, at most one
	// start every outageLogPeriod, so that a Redis that half works (the
	// breaker opening and closing again) does not flood the log.
	outageLogs throttle.Throttle
	outageSaid atomic.Bool  // its start was logged, its end not yet
	rtt        atomic.Int64 // a moving average of the calls' round trips, in nanoseconds
	// A refusal of the scripts is logged once, until Redis runs them
	// again, and at most once every outageLogPeriod; it names the user.
	refusalLogs throttle.Throttle
	refusalSaid atomic.Bool
	user        string
	checked     atomic.Bool // Check asked Redis

	// The stores that use the client, and the lines said of an outage or
	// a refusal that stands, for what the log says each store does while
	// Redis cannot decide (see Join).
	usersMu         sync.Mutex
	users           []*user
	outage, refusal *saying

	// The least lag seen lately between Redis's clock and this process's
	// receipt of a reply decided by it: what links the two clocks (see
	// DecidedAt).
	lagMu    sync.Mutex
	lag      time.Duration
	lagSince time.Time
}

// NewClient makes a client that runs scripts. go-redis panics on some
// options it refuses; the caller may be making a pooled value, which a
// panic would leave locked, so that becomes an error.
func NewClient(opts *redis.UniversalOptions, scripts *Scripts) (c *Client, err error) {
	defer func() {
		if r := recover(); r != nil {
			c, err = nil, fmt.Errorf("redis client: %v", r)
		}
	}()
	uc := redis.NewUniversalClient(opts)
	cc, cluster := uc.(*redis.ClusterClient)
	poolSize := cmp.Or(opts.PoolSize, 10*runtime.GOMAXPROCS(0)) // go-redis's default
	pipe := &pipeline{client: uc, scripts: scripts, cluster: cluster, maxFlights: maxFlights(poolSize)}
	return &Client{UniversalClient: uc, Cluster: cluster, cluster: cc, pipe: pipe, scripts: scripts, closed: make(chan struct{}),
		user: cmp.Or(opts.Username, "default")}, nil
}

// A user is a store of the client: its fail_mode, and the names of its
// zones that ask Redis.
type user struct {
	failMode string
	zones    []string
}

// Join records a store of the client, with its fail_mode and the names
// of its zones that ask Redis, so that the lines that say Redis cannot
// decide say what each store does meanwhile; leave ends it. A store that
// joins while such a line stands, with a fail_mode it does not name, has
// it said for its own, with logger.
func (c *Client) Join(logger *zap.Logger, failMode string, zones []string) (leave func()) {
	u := &user{failMode, zones}
	c.usersMu.Lock()
	c.users = append(c.users, u)
	for _, l := range []*saying{c.outage, c.refusal} {
		if l != nil {
			c.say(logger, l)
		}
	}
	c.usersMu.Unlock()
	return func() {
		c.usersMu.Lock()
		defer c.usersMu.Unlock()
		if i := slices.Index(c.users, u); i >= 0 {
			c.users = slices.Delete(c.users, i, i+1)
		}
	}
}

// A saying is a line that says Redis cannot decide: said once for each
// fail_mode of the client's stores, naming the zones it decides, so that
// stores that share a connection and differ in what they do are each
// told right.
type saying struct {
	msg           string
	before, after []zap.Field // around fail_mode and zones
	modes         map[string]bool
}

// say logs l for each fail_mode of the client's stores that it did not
// name yet, with the zones of that mode. Requires c.usersMu.
func (c *Client) say(logger *zap.Logger, l *saying) {
	if len(c.users) == 0 && !l.modes[""] { // no store yet: said without one
		l.modes[""] = true
		logger.Error(l.msg, slices.Concat(l.before, l.after)...)
	}
	for _, u := range c.users {
		if l.modes[u.failMode] {
			continue
		}
		l.modes[u.failMode] = true
		var zones []string
		for _, v := range c.users {
			for _, z := range v.zones {
				if v.failMode == u.failMode && !slices.Contains(zones, z) {
					zones = append(zones, z)
				}
			}
		}
		logger.Error(l.msg, slices.Concat(l.before, []zap.Field{zap.String("fail_mode", u.failMode), zap.Strings("zones", zones)}, l.after)...)
	}
}

// sayFor starts saying l, as the line of what *at holds, for every
// fail_mode of the client's stores.
func (c *Client) sayFor(at **saying, logger *zap.Logger, l *saying) {
	c.usersMu.Lock()
	defer c.usersMu.Unlock()
	l.modes = make(map[string]bool)
	*at = l
	c.say(logger, l)
}

// Destruct closes the client when no config uses it any more.
func (c *Client) Destruct() error {
	close(c.closed)
	return c.Close()
}

// Up reports whether calls go to Redis: its breaker is closed.
func (c *Client) Up() bool { return !c.breaker.open() }

// Answered records that Redis answered a call; a breaker that this
// closes is logged as a recovery. On a cluster, the call's master alone
// answered: that ends a run of outages, but the breaker of all the
// masters, once open, only closes when a probe finds each answering
// (were one master's answer enough, the breaker would open and close
// by turns while another is down, and a request's store would depend
// on which master answered last).
func (c *Client) Answered(logger *zap.Logger) {
	if c.cluster != nil {
		c.breaker.answered()
		return
	}
	c.recovered(logger)
}

// recovered closes the breaker, and logs a recovery if that closed it.
func (c *Client) recovered(logger *zap.Logger) {
	if c.breaker.success() {
		c.LogRecovery(logger)
	}
}

// Failed records an outage, seen by a call that failed with err. When it
// opens the breaker, the outage is logged, and Redis is probed in the
// background until it answers. A refusal of the scripts is not an
// outage, and is recorded as a refusal (see Refuse).
//
// On a cluster, the client also asks for the slots again at once (in the
// background, at most every 200 ms however many calls fail): go-redis
// learns where the slots are only from a MOVED or an ASK, which a dead
// master never sends, and otherwise once a minute, so the slots of a
// master that failed over would go on being sent to it for up to a
// minute after its replica took them over.
func (c *Client) Failed(logger *zap.Logger, err error) {
	if Classify(err) == Refused {
		c.Refuse(logger, err)
		return
	}
	if c.cluster != nil {
		c.cluster.ReloadState(context.Background())
	}
	if c.breaker.outage() {
		c.LogOutage(logger, err)
		go c.probe(logger)
	}
}

// Refuse records that Redis refuses the scripts, as err says: no call can
// succeed until its ACL or its modules change, so the breaker opens at
// once, rather than after outages in a row, and fail_mode decides every
// request without a call; the refusal is logged once. Redis is probed in
// the background, as after an outage, so the store decides again soon
// after the scripts are allowed.
func (c *Client) Refuse(logger *zap.Logger, err error) {
	c.LogRefusal(logger, err)
	if c.breaker.trip() {
		go c.probe(logger)
	}
}

// Check asks Redis once, within timeout, whether it runs scripts for
// this client's user: a script that does nothing, sent with EVAL and then
// EVALSHA, the commands the store runs its scripts by (the store's own
// are loaded by their first call, as without the check). A refusal is
// recorded (see Refuse) before any request pays a call for it; any other
// answer, NOSCRIPT included, or none (Caddy starts while Redis is down)
// is left to the requests, whose calls find a refusal as well when Redis
// comes. A client checks once: a reload that keeps it keeps what it found.
func (c *Client) Check(logger *zap.Logger, timeout time.Duration) {
	if !c.checked.CompareAndSwap(false, true) {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	err := checkScript.Eval(ctx, c, nil).Err()
	if err == nil {
		err = checkScript.EvalSha(ctx, c, nil).Err()
	}
	if err != nil && Classify(err) == Refused {
		c.Refuse(logger, err)
	}
}

// checkScript is the script Check sends: it does nothing.
var checkScript = redis.NewScript("return 0")

// probe asks Redis, after a backoff that doubles up to maxBackoff, until
// it answers as a decision needs: the decision script runs (it is loaded
// again if Redis lost it) and a write is accepted (a replica demoted after
// a failover refuses it, as it would refuse a decision). The first answer
// closes the breaker. A probe waits for its answer up to maxBackoff, and
// one that Redis would answer later is answered as soon as Redis can
// (a frozen Redis answers what it was sent when it thaws), so a Redis
// that is back decides again within maxBackoff and a round trip. It
// stops when the client is closed. A probe that Redis refuses the scripts
// logs the refusal, once (it may follow an outage).
func (c *Client) probe(logger *zap.Logger) {
	backoff := minBackoff
	for {
		select {
		case <-c.closed:
			return
		case <-time.After(backoff):
		}
		ctx, cancel := context.WithTimeout(context.Background(), maxBackoff)
		err := c.ping(ctx)
		cancel()
		if err == nil || Classify(err) == Answered {
			c.recovered(logger)
			return
		}
		if Classify(err) == Refused {
			c.LogRefusal(logger, err)
		}
		backoff = min(2*backoff, maxBackoff)
	}
}

// probeKey is the key a probe's write asks for: an expiry of a key that
// does not exist, which writes nothing.
const probeKey = "{rate_limit}probe"

// ping is one probe. On a cluster, the script runs on every master of
// the slots as the cluster says they are now (go-redis asks for them
// again first), so that the breaker closes when all the masters answer,
// new ones that took over a dead one's slots included, and not while one
// of them is still down.
func (c *Client) ping(ctx context.Context) error {
	if err := c.decideNothing(ctx); err != nil {
		return err
	}
	return c.PExpire(ctx, probeKey, time.Millisecond).Err()
}

// decideNothing runs the decision script without decisions, loading it
// if Redis lacks it.
func (c *Client) decideNothing(ctx context.Context) error {
	run := func(ctx context.Context, r redis.Scripter) error {
		return c.scripts.decide.Run(ctx, r, nil, "", 0, 0).Err()
	}
	if c.cluster != nil {
		return c.cluster.ForEachMaster(ctx, func(ctx context.Context, m *redis.Client) error { return run(ctx, m) })
	}
	return run(ctx, c.UniversalClient)
}

// Run sends call, through the pipeline, and returns its reply by the
// call's deadline; call goes back to its pool.
func (c *Client) Run(ctx context.Context, call *Call) (Reply, error) {
	return c.pipe.run(ctx, call)
}

// RunAll sends calls as one flight of their own, decided in their order,
// and returns each one's reply and error by the earliest deadline among
// them; the calls go back to their pool.
func (c *Client) RunAll(calls []*Call) ([]Reply, []error) {
	c.pipe.fly(calls)
	replies, errs := make([]Reply, len(calls)), make([]error, len(calls))
	for i, call := range calls {
		<-call.done
		replies[i], errs[i] = call.answer()
		call.free()
	}
	return replies, errs
}

// lagFor is how long the least lag between Redis's clock and a reply's
// receipt is trusted before a new one replaces it: clocks drift, and may
// be stepped.
const lagFor = time.Second

// DecidedAt is the instant, on this process's clock, at which Redis
// decided a call that was sent at sent, replied r: within [sent, the
// reply's arrival], and on that time line where Redis's clock puts it.
// The two clocks are linked by the reply that came back soonest after its
// decision lately (which came back no sooner than it was decided, so the
// instant is never earlier than the decision), so that a reservation
// counts from when Redis made it, not from when a busy process read its
// reply.
func (c *Client) DecidedAt(r Reply, sent time.Time) time.Time {
	recv := r.At()
	lag := recv.Sub(r.Clock())
	c.lagMu.Lock()
	if lag < c.lag || recv.Sub(c.lagSince) > lagFor {
		c.lag, c.lagSince = lag, recv
	}
	least := c.lag
	c.lagMu.Unlock()
	at := recv.Add(least - lag)
	if at.Before(sent) {
		at = sent
	}
	return at
}

// NoteRTT adds a call's round trip to the moving average.
func (c *Client) NoteRTT(d time.Duration) {
	old := c.rtt.Load()
	c.rtt.Store(old + (int64(d)-old)/8)
}

// RTT is the moving average of the calls' round trips.
func (c *Client) RTT() time.Duration { return time.Duration(c.rtt.Load()) }

const outageLogPeriod = 10 * time.Second

// LogOutage logs that Redis went away, once for each fail_mode of the
// client's stores (see Join), unless an outage was logged less than
// outageLogPeriod ago; a probe that fails tries again.
func (c *Client) LogOutage(logger *zap.Logger, err error) {
	if c.outageSaid.Load() {
		return
	}
	if _, ok := c.outageLogs.Allow(outageLogPeriod); ok && c.outageSaid.CompareAndSwap(false, true) {
		c.sayFor(&c.outage, logger, &saying{msg: "redis store unavailable: deciding by fail_mode until it answers again",
			after: []zap.Field{zap.Error(err)}})
	}
}

// LogRefusal logs, at ERROR, that Redis refuses the scripts (err says
// how), what the store needs and why, once for each fail_mode of the
// client's stores (see Join), unless that was logged since the store
// last decided, or less than outageLogPeriod ago. The reply is
// logged without the arguments it may echo, among which are keys.
func (c *Client) LogRefusal(logger *zap.Logger, err error) {
	if c.refusalSaid.Load() {
		return
	}
	if _, ok := c.refusalLogs.Allow(outageLogPeriod); !ok || !c.refusalSaid.CompareAndSwap(false, true) {
		return
	}
	reply, _ := scriptsRefused(err)
	msg := "redis cannot run the scripts the store decides by: it needs Lua scripting " +
		"(EVALSHA, and EVAL when Redis lacks the script; on Valkey 9.1 and later, its Lua module loaded); " +
		"until then fail_mode decides every request"
	if strings.HasPrefix(reply, "NOPERM") {
		msg = "redis refuses this user the scripts the store decides by: grant it +evalsha +eval " +
			"(each decision is a Lua script, run with EVALSHA, and with EVAL when Redis lacks it); " +
			"until then fail_mode decides every request"
	}
	c.sayFor(&c.refusal, logger, &saying{msg: msg,
		before: []zap.Field{zap.String("user", c.user)}, after: []zap.Field{zap.String("error", reply)}})
}

// LogRecovery logs that Redis answers again, if its going, or its refusal
// of the scripts, was logged.
func (c *Client) LogRecovery(logger *zap.Logger) {
	outage, refusal := c.outageSaid.Swap(false), c.refusalSaid.Swap(false)
	if outage || refusal {
		c.usersMu.Lock()
		c.outage, c.refusal = nil, nil
		c.usersMu.Unlock()
		logger.Info("redis store available again")
	}
}
