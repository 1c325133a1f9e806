// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package redisstore_test

import (
	"context"
	_ "embed"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/calendar"
	"github.com/caddy-tokenbucket/ratelimit/internal/gcra"
	"github.com/caddy-tokenbucket/ratelimit/internal/memstore"
	"github.com/caddy-tokenbucket/ratelimit/internal/redisstore"
	"github.com/caddy-tokenbucket/ratelimit/internal/redistest"
	"github.com/caddy-tokenbucket/ratelimit/internal/rediswire"
	"github.com/caddy-tokenbucket/ratelimit/internal/store"
	"github.com/caddy-tokenbucket/ratelimit/lua"
	"github.com/redis/go-redis/v9"
)

// The zones of the flight tests, by their letters: plain buckets (a 10r/s
// burst 3, and c 2r/s burst 4 of two tokens a request), a ban (e 1r/s
// burst 2, banning for 2s), a quota alone (q, 5 a day), a zone whose
// limit comes with each request (p, at plan free 1r/s burst 2 or pro
// 10r/s burst 5), and one with keys of their own limit (v 5r/s burst 4).
// The quota's windows are quotaWindow long.
var (
	flightLetters = "aceqpv"
	flightLimits  = map[byte]gcra.Limit{'a': gcra.NewLimit(10, 3), 'c': gcra.NewLimit(2, 4), 'e': withBan(gcra.NewLimit(1, 2), 2*time.Second),
		'v': gcra.NewLimit(5, 4)}
	flightCosts  = map[byte]int64{'c': 2}
	flightQuota  = int64(5)
	planLimits   = map[string]gcra.Limit{"free": gcra.NewLimit(1, 2), "pro": gcra.NewLimit(10, 5)}
	quotaWindows = &calendar.Windows{Every: quotaWindow}
)

// quotaWindow is the length of the quotas' windows in the tests, which
// start at a window's start.
const quotaWindow = 100 * time.Second

func withBan(l gcra.Limit, ban time.Duration) gcra.Limit {
	l.Ban = ban
	return l
}

// flightSpecs are the specs of the flight zones, in flightLetters' order.
func flightSpecs() []store.ZoneSpec {
	specs := make([]store.ZoneSpec, len(flightLetters))
	for i, c := range []byte(flightLetters) {
		specs[i] = store.ZoneSpec{Name: string(c), Bucket: c != 'q', Shape: flightLimits[c], MaxOverrides: 10}
		if c == 'q' {
			specs[i].Shape, specs[i].Quota = gcra.NewLimit(1, 1), "day@UTC"
		}
	}
	return specs
}

// A flight request: the zones it matches (an upper-case letter is the
// zone's quota), its key, and its plan in zone p.
type flightReq struct {
	zones, key, plan string
}

// flightDemands are r's demands at now, as the handler makes them.
func flightDemands(now time.Time, r flightReq) *store.Demands {
	d := new(store.Demands)
	k := store.Key{Text: r.key}
	for _, c := range []byte(r.zones) {
		if c >= 'A' && c <= 'Z' {
			zone := strings.IndexByte(flightLetters, c-'A'+'a')
			d.Counters = append(d.Counters, store.CounterDemand{Zone: zone, Key: k, Limit: flightQuota, Cost: 1, Window: quotaWindows.Window(now)})
			continue
		}
		l := flightLimits[c]
		if c == 'p' {
			l = planLimits[r.plan]
		}
		d.Buckets = append(d.Buckets, store.BucketDemand{Zone: strings.IndexByte(flightLetters, c), Key: k, Limit: l, Cost: l.CostTime(max(flightCosts[c], 1))})
	}
	return d
}

// flightAnswer is what a request was answered: allowed, and per demand
// the tokens (or units) left and whether a ban started.
func flightAnswer(ok bool, d *store.Demands) string {
	var b strings.Builder
	fmt.Fprint(&b, ok)
	for i := range d.Buckets {
		q := &d.Buckets[i]
		fmt.Fprintf(&b, " %d/%d", q.Remaining(), q.Limit.Burst)
		if q.Ban {
			b.WriteString(" ban")
		}
	}
	for i := range d.Counters {
		fmt.Fprintf(&b, " Q%d", d.Counters[i].Remaining())
	}
	return b.String()
}

// memTables make a store's tables in memory, each fresh: the local
// store's engine, for what Redis must answer alike.
type memTables struct{}

func (memTables) Buckets(memstore.TableID, time.Duration) (*memstore.Table[memstore.Bucket], error) {
	return memstore.NewBuckets(10_000, time.Now()), nil
}

func (memTables) Counters(memstore.TableID) (*memstore.Table[memstore.Counter], error) {
	return memstore.NewCounters(10_000, time.Now()), nil
}

func (memTables) Slots(string) (*memstore.SlotTable, error) {
	return memstore.NewSlotTable(10_000), nil
}

// The decisions of a flight, sent to Redis in one script call, are each
// what it would be alone, one after another: requests of every kind of
// zone, in flights of 1 to 40 at one instant (with runs of one request
// repeated), get from Redis what the local store answers them one by
// one.
func TestFlightMatchesLocal(t *testing.T) {
	r := redistest.Start(t)
	local, err := memstore.New(flightSpecs(), memTables{})
	if err != nil {
		t.Fatal(err)
	}
	var now time.Time
	rs := redisstore.Open(t, redisstore.OpenClient(t, r.Addr()), flightSpecs(),
		redisstore.Options{DisableOverLimitCache: true, Clock: func() time.Time { return now }})
	now = time.Unix(time.Now().Add(quotaWindow).Unix()/100*100, 0)
	ctx := context.Background()

	// Key o1 has its own limit in v on both stores.
	for _, s := range []store.Store{local, rs} {
		o := store.Override{TokenTime: time.Second, Burst: 2, Rate: "1r/s"}
		if err := s.SetOverride(ctx, now, strings.IndexByte(flightLetters, 'v'), store.Key{Text: "o1"}, o); err != nil {
			t.Fatal(err)
		}
	}

	rnd := rand.New(rand.NewPCG(1, 2))
	kinds := []string{"a", "c", "e", "Q", "p", "v", "ac", "aQ", "ev", "pQ", "acv", "aeQ", "cpv"}
	keys := []string{"k1", "k2", "k3", "o1"}
	plans := []string{"free", "pro"}
	decided, refused := 0, 0
	for flight := range 60 {
		now = now.Add(time.Duration(rnd.IntN(400)) * time.Millisecond)
		reqs := make([]flightReq, 1+rnd.IntN(40))
		for i := range reqs {
			reqs[i] = flightReq{kinds[rnd.IntN(len(kinds))], keys[rnd.IntN(len(keys))], plans[rnd.IntN(2)]}
			if i > 0 && rnd.IntN(3) == 0 {
				reqs[i] = reqs[i-1] // a flood of one key: runs of takes of one bucket
			}
		}
		ds := make([]*store.Demands, len(reqs))
		for i, q := range reqs {
			ds[i] = flightDemands(now, q)
		}
		calls := r.Calls()
		allowed, errs := rs.RunAll(rediswire.Take, ds)
		// (The first is sent again as EVAL: Redis has not seen the script.)
		if n := r.Calls() - calls; n != 1 && (flight > 0 || n != 2) {
			t.Fatalf("flight %d of %d decisions: %d script calls, want 1", flight, len(reqs), n)
		}
		for i, q := range reqs {
			if errs[i] != nil {
				t.Fatalf("flight %d, request %d %+v: %v", flight, i, q, errs[i])
			}
			d := flightDemands(now, q)
			ok, err := local.Take(ctx, now, d)
			if err != nil {
				t.Fatal(err)
			}
			if got, want := flightAnswer(allowed[i], ds[i]), flightAnswer(ok, d); got != want {
				t.Fatalf("flight %d, request %d of %d %+v: Redis answered %s, the local store %s", flight, i, len(reqs), q, got, want)
			}
			decided++
			if !ok {
				refused++
			}
		}
	}
	// The table means something only if both answers came up often.
	if refused < decided/10 || refused > decided*9/10 {
		t.Fatalf("%d of %d requests refused: the flights do not test both answers", refused, decided)
	}
}

// On a Redis Cluster a flight is one script call per hash tag among its
// decisions, each on its slot's master: 60 takes of 12 keys in one
// flight are answered as one after another, in as many calls as the
// keys have tags.
func TestClusterFlight(t *testing.T) {
	nodes := redistest.StartCluster(t)
	l := gcra.NewLimit(1.0/60, 4)
	rs := redisstore.Open(t, redisstore.OpenClient(t, nodes[0].Addr(), nodes[1].Addr(), nodes[2].Addr()),
		[]store.ZoneSpec{redisstore.Bucket("cf", l)}, redisstore.Options{DisableOverLimitCache: true})
	var ds []*store.Demands
	tags := map[string]bool{}
	for i := range 60 {
		k := fmt.Sprint("192.0.2.", i%12)
		ds = append(ds, redisstore.TakeOf(0, k, l))
		hash, _ := rs.BucketName(0, store.Key{Text: k})
		tags[hash[:strings.IndexByte(hash, '}')+1]] = true
	}
	if len(tags) < 4 {
		t.Fatalf("12 keys have %d hash tags: the flight would not be split", len(tags))
	}
	// The script is loaded on every master, so that no call is sent twice.
	var before int64
	for _, n := range nodes {
		if err := redis.NewScript(lua.Decide).Load(context.Background(), newRedisClient(t, n.Addr())).Err(); err != nil {
			t.Fatal(err)
		}
		c, _ := n.ScriptStats()
		before += c
	}
	allowed, errs := rs.RunAll(rediswire.Take, ds)
	var after int64
	for _, n := range nodes {
		c, _ := n.ScriptStats()
		after += c
	}
	for i := range ds {
		// Each key's first four takes (i < 48) are allowed, the fifth refused.
		if errs[i] != nil || allowed[i] != (i < 48) {
			t.Fatalf("take %d (key %d, take %d): allowed %v, %v", i, i%12, i/12+1, allowed[i], errs[i])
		}
		if got, want := ds[i].Buckets[0].Remaining(), max(int64(3-i/12), 0); got != want {
			t.Fatalf("take %d: %d tokens left, want %d", i, got, want)
		}
	}
	if n := after - before; n != int64(len(tags)) {
		t.Fatalf("a flight of %d keys with %d hash tags made %d script calls", 12, len(tags), n)
	}
}

// beforeFlightsLua is the decision script of the build before flights:
// one decision a call, its clock in ARGV[2], its reply ending with it.
//
//go:embed testdata/scripts/token_bucket_before_flights.lua
var beforeFlightsLua string

// Buckets keep their layout across the upgrade to flights, and back: a
// key's takes, each sent at random to the script before flights or to
// today's, are decided as the script before flights decides them all,
// to the nanosecond, in plain zones and in one with a ban.
func TestUpgradeFromBeforeFlights(t *testing.T) {
	r := redistest.Start(t)
	limits := []gcra.Limit{gcra.NewLimit(4, 3), withBan(gcra.NewLimit(2, 2), time.Second)}
	zones := []store.ZoneSpec{redisstore.Bucket("up", limits[0]), redisstore.Bucket("upban", limits[1])}
	var now time.Time
	open := func(prefix string) *redisstore.Store {
		return redisstore.Open(t, redisstore.OpenClient(t, r.Addr()), zones,
			redisstore.Options{KeyPrefix: prefix, DisableOverLimitCache: true, Clock: func() time.Time { return now }})
	}
	mixed, before := open("up-mixed:"), open("up-before:")
	old := redis.NewScript(beforeFlightsLua)
	c := newRedisClient(t, r.Addr())
	ctx := context.Background()
	// takeBefore decides d's one bucket by the script before flights.
	takeBefore := func(s *redisstore.Store, d *store.Demands) (bool, time.Duration) {
		b := &d.Buckets[0]
		hash, field, limit := s.BucketLimit(b.Zone, b.Key)
		sh := s.ShapeOf(b)
		v, err := old.Run(ctx, c, []string{hash, limit}, "take", now.UnixMicro(), 1, 0, 0,
			field, int64(sh.Full), int64(sh.Cost), int64(sh.Ban), int64(sh.Beyond), int64(sh.Reserve), 0, int64(sh.Token)).Int64Slice()
		if err != nil {
			t.Fatal(err)
		}
		return v[0] == 1, time.Duration(v[2])
	}
	rnd := rand.New(rand.NewPCG(3, 4))
	now = time.Now()
	news, refused := 0, 0
	for i := range 400 {
		now = now.Add(time.Duration(rnd.IntN(300)) * time.Millisecond)
		zi := rnd.IntN(2)
		key := store.Key{Text: fmt.Sprint("k", rnd.IntN(3))}
		demand := func() *store.Demands { return redisstore.TakeOf(zi, key.Text, limits[zi]) }
		wantOK, wantDebt := takeBefore(before, demand())
		d := demand()
		var ok bool
		var debt time.Duration
		if rnd.IntN(2) == 0 {
			ok, debt = takeBefore(mixed, d)
		} else {
			allowed, errs := mixed.RunAll(rediswire.Take, []*store.Demands{d})
			if errs[0] != nil {
				t.Fatal(errs[0])
			}
			ok, debt = allowed[0], d.Buckets[0].Debt
			news++
		}
		if ok != wantOK || debt != wantDebt {
			t.Fatalf("take %d (zone %d, %s): allowed %v owing %v; before flights: %v owing %v", i, zi, key.Text, ok, debt, wantOK, wantDebt)
		}
		if !ok {
			refused++
		}
	}
	if news < 100 || refused < 40 {
		t.Fatalf("%d takes by today's script, %d refused: too few to tell", news, refused)
	}
}

// Concurrent decisions share pipelined batches: each still gets its own
// exact answer, also right after a SCRIPT FLUSH (the batch's calls find no
// script and are sent again with it), on one Redis and on a cluster.
func TestPipelinedDecisionsAreExact(t *testing.T) {
	single := redistest.Start(t)
	nodes := redistest.StartCluster(t)
	for _, tc := range []struct {
		name  string
		addrs []string
		flush func()
	}{
		{"standalone", []string{single.Addr()}, func() { single.CLI("SCRIPT", "FLUSH") }},
		{"cluster", []string{nodes[0].Addr(), nodes[1].Addr(), nodes[2].Addr()}, func() {
			for _, n := range nodes {
				n.CLI("SCRIPT", "FLUSH")
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := gcra.NewLimit(1.0/3600, 10)
			s := redisstore.Open(t, redisstore.OpenClientWith(t, redisstore.ClientOptions{PoolSize: 4}, tc.addrs...),
				[]store.ZoneSpec{redisstore.Bucket("pipe", l)}, redisstore.Options{DisableOverLimitCache: true})
			const keys, callers, tries = 20, 64, 40
			for round := range 2 {
				tc.flush()
				var allowed [keys]atomic.Int64
				var wg sync.WaitGroup
				for c := range callers {
					wg.Go(func() {
						for i := range tries {
							k := (c + i) % keys
							ok, err := s.Take(context.Background(), time.Now(), redisstore.TakeOf(0, fmt.Sprintf("r%d-k%d", round, k), l))
							if err != nil {
								t.Error(err)
								return
							}
							if ok {
								allowed[k].Add(1)
							}
						}
					})
				}
				wg.Wait()
				for k := range allowed {
					if n := allowed[k].Load(); n != 10 {
						t.Fatalf("round %d: key %d allowed %d times, want its burst of 10", round, k, n)
					}
				}
			}
		})
	}
}

// Takes of one bucket queued together (a flood on one key) are decided
// in the flight's one script call, one after another, each with the
// reply it would get alone: the bucket's burst allowed, the rest denied,
// and the debts of eight takes one at a time, to the nanosecond.
func TestFlightOfOneKey(t *testing.T) {
	r := redistest.Start(t)
	l := gcra.NewLimit(7.0/3600, 5)
	now := time.Now()
	s := redisstore.Open(t, redisstore.OpenClientWith(t, redisstore.ClientOptions{PoolSize: 2}, r.Addr()),
		[]store.ZoneSpec{redisstore.Bucket("twin", l)},
		// The same instant for all: the same debts.
		redisstore.Options{DisableOverLimitCache: true, Clock: func() time.Time { return now }})
	take := func(key string) (bool, time.Duration) {
		d := redisstore.TakeOf(0, key, l)
		ok, err := s.Take(context.Background(), time.Now(), d)
		if err != nil {
			t.Error(err)
		}
		return ok, d.Buckets[0].Debt
	}
	// Alone, one after another.
	var alone []string
	for range 8 {
		ok, debt := take("alone")
		alone = append(alone, fmt.Sprint(ok, debt))
	}
	// Together: a script keeps Redis busy while one take holds the only
	// flight, and eight takes of one key and one of another queue up. It
	// spins 400ms by os.clock where the server has it (Valkey, whose TIME
	// is the script's start throughout), else by TIME (Redis 7.0 has no
	// os, and its TIME moves on during a script).
	calls := r.Calls()
	busy := make(chan struct{})
	go func() {
		defer close(busy)
		r.CLI("EVAL", "local os = rawget(_G, 'os') local function now() if os then return os.clock() * 1e6 end "+
			"local t = redis.call('TIME') return t[1] * 1e6 + t[2] end "+
			"local e = now() + 400000 repeat until now() > e", "0")
	}()
	time.Sleep(100 * time.Millisecond)
	var wg sync.WaitGroup
	wg.Go(func() { take("first") })
	time.Sleep(50 * time.Millisecond)
	var mu sync.Mutex
	var together []string
	for range 8 {
		wg.Go(func() {
			ok, debt := take("flood")
			mu.Lock()
			together = append(together, fmt.Sprint(ok, debt))
			mu.Unlock()
		})
	}
	wg.Go(func() { take("other") })
	wg.Wait()
	<-busy
	slices.Sort(alone)
	slices.Sort(together)
	if !slices.Equal(together, alone) {
		t.Fatalf("together %q, want as alone %q", together, alone)
	}
	token := l.TokenTime // 1/7 h: not a whole number of microseconds
	var want []string
	for n := range 8 {
		want = append(want, fmt.Sprint(n < 5, time.Duration(min(n+1, 5))*token))
	}
	slices.Sort(want)
	if !slices.Equal(alone, want) {
		t.Fatalf("alone %q, want %q", alone, want)
	}
	if n := r.Calls() - calls; n != 3 {
		t.Fatalf("%d script calls, want 3: the busy one, the first, and one flight of the flood's and the other key's", n)
	}
}
