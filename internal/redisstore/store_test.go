// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package redisstore_test

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/calendar"
	"github.com/caddy-tokenbucket/ratelimit/internal/gcra"
	"github.com/caddy-tokenbucket/ratelimit/internal/redisstore"
	"github.com/caddy-tokenbucket/ratelimit/internal/redistest"
	"github.com/caddy-tokenbucket/ratelimit/internal/rediswire"
	"github.com/caddy-tokenbucket/ratelimit/internal/store"
	"github.com/caddy-tokenbucket/ratelimit/internal/store/storetest"
	"github.com/redis/go-redis/v9"
)

// The Redis engine decides the conformance suite's steps as every store
// must: on one Redis without its over-limit cache (and with the steps of
// each instant sent as one flight, one script call), with it, and on a
// Redis Cluster of three masters, where a request's keys share a slot.
func TestConformance(t *testing.T) {
	r := redistest.Start(t)
	t.Run("no cache", func(t *testing.T) {
		storetest.Run(t, storesOn([]string{r.Addr()}, false), storetest.Flights(func(s store.Store, ds []*store.Demands) ([]bool, []error) {
			return s.(*redisstore.Store).RunAll(rediswire.Take, ds)
		}))
	})
	t.Run("over-limit cache", func(t *testing.T) {
		storetest.Run(t, storesOn([]string{r.Addr()}, true))
	})
	t.Run("cluster", func(t *testing.T) {
		nodes := redistest.StartCluster(t)
		storetest.Run(t, storesOn([]string{nodes[0].Addr(), nodes[1].Addr(), nodes[2].Addr()}, false))
	})
}

// storesOn makes stores on the Redis at addrs (several: a cluster), with
// or without the over-limit cache, as the module makes them (its client's
// options, the scripts), on the suite's clock and under a key prefix of
// the test's own. A decision may take a second: no more, as the
// over-limit cache waits out, in the process's time, a bound it learnt
// that is closer than the timeout (a round trip past it), which the
// replay's instants do not follow.
func storesOn(addrs []string, cache bool) storetest.NewStore {
	return func(t *testing.T, zones []store.ZoneSpec, clock func() time.Time) store.Store {
		// No zone of the suite has sync: the store makes no copies.
		return redisstore.Open(t, redisstore.OpenClient(t, addrs...), zones,
			redisstore.Options{FailMode: "local", DisableOverLimitCache: !cache, CallTimeout: time.Second, Clock: clock})
	}
}

// Clients that go away cancel their requests' contexts: that says nothing
// of Redis, and must not open the circuit breaker.
func TestCancelledRequestsKeepBreakerClosed(t *testing.T) {
	r := redistest.Start(t)
	l := gcra.NewLimit(1.0/60, 100)
	s := redisstore.Open(t, redisstore.OpenClient(t, r.Addr()), []store.ZoneSpec{redisstore.Bucket("cancel", l)}, redisstore.Options{})
	for range 6 { // twice the outages in a row that open it
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		if _, err := s.Take(ctx, time.Now(), redisstore.TakeOf(0, "gone", l)); err == nil {
			t.Fatal("a cancelled request reached a decision")
		}
	}
	if s.Stats(0).Unavailable {
		t.Fatal("cancelled requests opened the circuit breaker")
	}
	if ok, err := s.Take(context.Background(), time.Now(), redisstore.TakeOf(0, "next", l)); !ok || err != nil {
		t.Fatalf("the next request: %v, %v", ok, err)
	}
	hash, field := s.BucketName(0, store.Key{Text: "next"})
	if r.CLI("HEXISTS", hash, field) != "1" {
		t.Fatal("the next request was not decided by Redis")
	}
}

// ipKey is the key of a client's IPv4 address, as the handler makes it.
func ipKey(ip string) store.Key {
	return store.Key{Net: netip.PrefixFrom(netip.MustParseAddr(ip), 32)}
}

// A bucket's instant is whole nanoseconds however far from 2025: read
// back in 2090, each token of 7r/s (not a whole number of microseconds)
// still adds 1/7 s to the nanosecond, and the hash holds the instant the
// replies say.
func TestInstantsStayExact(t *testing.T) {
	r := redistest.Start(t)
	l := gcra.NewLimit(7, 5)
	now := time.Date(2090, 6, 1, 0, 0, 0, 123_456_000, time.UTC)
	s := redisstore.Open(t, redisstore.OpenClient(t, r.Addr()), []store.ZoneSpec{redisstore.Bucket("late", l)},
		redisstore.Options{Clock: func() time.Time { return now }})
	var debts []time.Duration
	for range 4 {
		d := redisstore.TakeOf(0, "k", l)
		if ok, err := s.Take(context.Background(), now, d); !ok || err != nil {
			t.Fatalf("take %d: %v, %v", len(debts)+1, ok, err)
		}
		debts = append(debts, d.Buckets[0].Debt)
	}
	for i := 1; i < len(debts); i++ {
		if d := debts[i] - debts[i-1]; d < 142857142 || d > 142857143 {
			t.Fatalf("debts %v: token %d added %v, want 1/7 s to the nanosecond", debts, i+1, d)
		}
	}
	hash, field := s.BucketName(0, store.Key{Text: "k"})
	want := now.Sub(time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)) + debts[3]
	if v := r.CLI("HGET", hash, field); v != strconv.FormatInt(int64(want), 10) {
		t.Fatalf("stored instant %s, want %d", v, want)
	}
}

// Buckets that are full again stay in their hash until it expires, or
// until new buckets find them: each new one looks at three others. So
// clients that come and go, while the hash never goes quiet, leave it
// at most a few times the size of its live buckets.
func TestRefilledBucketsArePurged(t *testing.T) {
	r := redistest.Start(t)
	c := newRedisClient(t, r.Addr())
	ctx := context.Background()
	l := gcra.NewLimit(1.0/3600, 1)
	var now time.Time
	s := redisstore.Open(t, redisstore.OpenClient(t, r.Addr()), []store.ZoneSpec{redisstore.Bucket("p", l)},
		redisstore.Options{Clock: func() time.Time { return now }})
	start := time.Now()
	// Keys of one group, found by trying.
	hash, _ := s.BucketName(0, store.Key{Text: "k0"})
	var keys []string
	for i := 0; len(keys) < 400; i++ {
		k := fmt.Sprintf("k%d", i)
		if hk, _ := s.BucketName(0, store.Key{Text: k}); hk == hash {
			keys = append(keys, k)
		}
	}
	// Each key takes its token and is full again an hour later, when
	// the next key comes: one live bucket at a time.
	for i, k := range keys {
		now = start.Add(time.Duration(i) * time.Hour)
		if ok, err := s.Take(ctx, now, redisstore.TakeOf(0, k, l)); err != nil || !ok {
			t.Fatalf("key %d: %v, %v", i, ok, err)
		}
	}
	n, err := c.HLen(ctx, hash).Result()
	if err != nil || n < 1 || n > 4 {
		t.Fatalf("%d buckets in the hash after 400 one-off clients, %v; want a few", n, err)
	}
	// A bucket that is not an instant is taken away too.
	c.HSet(ctx, hash, "p:garbage", "x")
	for i := range 50 {
		now = start.Add(time.Duration(400+i) * time.Hour)
		s.Take(ctx, now, redisstore.TakeOf(0, keys[i], l))
	}
	if ok, _ := c.HExists(ctx, hash, "p:garbage").Result(); ok {
		t.Fatal("a field that is not an instant survived 50 new buckets")
	}
}

// A key of another type under the store's prefix is the store's to
// repair: the next decision overwrites it, and it never trips the
// circuit breaker (before, each was a store error, and three opened the
// breaker for every client).
func TestWrongTypeKeyRepaired(t *testing.T) {
	r := redistest.Start(t)
	c := newRedisClient(t, r.Addr())
	l := redisstore.PerMinute(1)
	s := redisstore.Open(t, redisstore.OpenClient(t, r.Addr()), []store.ZoneSpec{redisstore.Bucket("bad", l)}, redisstore.Options{FailMode: "closed"})
	takes := func(key string) string {
		var out []string
		for range 2 {
			ok, err := s.Take(context.Background(), time.Now(), redisstore.TakeOf(0, key, l))
			out = append(out, fmt.Sprint(ok, err))
		}
		return strings.Join(out, " ")
	}
	for i := range 6 { // twice the outages in a row that open the breaker
		key := fmt.Sprintf("192.0.2.%d", 10+i)
		hash, field := s.BucketName(0, store.Key{Text: key})
		c.Del(context.Background(), hash)
		c.SAdd(context.Background(), hash, "x")
		if got := takes(key); got != "true <nil> false <nil>" {
			t.Fatalf("key %d of the wrong type: %s, want allowed then refused (the bucket repaired, then empty)", i, got)
		}
		if typ := r.CLI("TYPE", hash); typ != "hash" || r.CLI("HEXISTS", hash, field) != "1" {
			t.Fatalf("key %d: type %s after a decision, want a hash with the bucket", i, typ)
		}
	}
	if s.Stats(0).Unavailable {
		t.Fatal("keys of the wrong type opened the circuit breaker")
	}
	// A value that is not an instant is a full bucket too, and so is an
	// instant of the version before buckets shared hashes.
	for i, v := range []string{"garbage", "63072000000000.123"} {
		key := fmt.Sprintf("192.0.2.%d", 99-i)
		hash, field := s.BucketName(0, store.Key{Text: key})
		c.HSet(context.Background(), hash, field, v)
		if got := takes(key); got != "true <nil> false <nil>" {
			t.Fatalf("value %q: %s, want allowed then refused", v, got)
		}
	}
}

// Zone names hold any characters, yet a zone's keys never meet another
// zone's: the name ends where the hash tag's '{' starts, and a '{' in a
// name is escaped.
func TestZoneNamesDoNotCollide(t *testing.T) {
	r := redistest.Start(t)
	l := redisstore.PerMinute(1)
	var stores []*redisstore.Store
	for _, name := range []string{"api:v1", "api", "api{v1"} {
		stores = append(stores, redisstore.Open(t, redisstore.OpenClient(t, r.Addr()), []store.ZoneSpec{redisstore.Bucket(name, l)},
			redisstore.Options{KeyPrefix: "t:"}))
	}
	keys := []string{"k", "v1:k", "k"}
	take := func(i int) bool {
		ok, err := stores[i].Take(context.Background(), time.Now(), redisstore.TakeOf(0, keys[i], l))
		if err != nil {
			t.Fatal(err)
		}
		return ok
	}
	if !take(0) || take(0) {
		t.Fatal("zone api:v1: want its one token, then a refusal")
	}
	for i := 1; i < 3; i++ {
		if !take(i) {
			t.Errorf("zone %d refused its first request: it shares api:v1's bucket", i)
		}
	}
	var fields []string
	for i, s := range stores {
		hash, field := s.BucketName(0, store.Key{Text: keys[i]})
		if r.CLI("HEXISTS", hash, field) != "1" {
			t.Errorf("zone %d: no bucket %s in %s", i, field, hash)
		}
		fields = append(fields, field)
	}
	// TVPR is the tag of the shape 1r/m burst 1: buckets written by one
	// version must be found by the next, so it never changes.
	if want := []string{"api%3Av1:TVPR:k", "api:TVPR:v1:k", "api{v1:TVPR:k"}; !slices.Equal(fields, want) {
		t.Errorf("fields %q, want %q", fields, want)
	}
}

// Memory per bucket in Redis, as docs/performance.md states it: what
// INFO's used_memory grows by per bucket, written through the store with
// 64 callers, must stay under 100 B. 100k IPv4 keys by default (a long
// minute under -race); RATE_LIMIT_MEMORY_KEYS=1000000 for the docs'
// figure. Logged with -v: MEMORY USAGE of sample hashes per bucket, and,
// for the same keys, what the layout before buckets shared hashes costs
// (a string key per bucket holding a 17-digit float, with PX), written
// as that version's script wrote it.
func TestMemoryPerKey(t *testing.T) {
	if testing.Short() {
		t.Skip("writes 100k keys")
	}
	n := 100_000
	if v := os.Getenv("RATE_LIMIT_MEMORY_KEYS"); v != "" {
		var err error
		if n, err = strconv.Atoi(v); err != nil || n < 1 || n > 1<<24 {
			t.Fatalf("RATE_LIMIT_MEMORY_KEYS=%q", v)
		}
	}
	r := redistest.Start(t)
	c := newRedisClient(t, r.Addr())
	ctx := context.Background()
	used := func() int64 {
		info := r.CLI("INFO", "memory")
		for _, line := range strings.Split(info, "\n") {
			if v, ok := strings.CutPrefix(strings.TrimSpace(line), "used_memory:"); ok {
				n, _ := strconv.ParseInt(v, 10, 64)
				return n
			}
		}
		t.Fatalf("no used_memory in %q", info)
		return 0
	}
	ip := func(i int) string { return fmt.Sprintf("10.%d.%d.%d", i>>16&255, i>>8&255, i&255) }

	// 7r/h: a token is not a whole number of microseconds, as with most
	// rates, so the layout before stored a fraction; and the buckets last
	// the whole test.
	l := gcra.NewLimit(7.0/3600, 10)
	s := redisstore.Open(t, redisstore.OpenClientWith(t, redisstore.ClientOptions{Timeout: 10 * time.Second}, r.Addr()),
		[]store.ZoneSpec{redisstore.Bucket("rb", l)}, redisstore.Options{KeyPrefix: "t:", CallTimeout: 10 * time.Second})
	before := used()
	start := time.Now()
	var next atomic.Int64
	var wg sync.WaitGroup
	for range 64 {
		wg.Go(func() {
			for i := int(next.Add(1) - 1); i < n; i = int(next.Add(1) - 1) {
				d := &store.Demands{Buckets: []store.BucketDemand{{Key: ipKey(ip(i)), Limit: l, Cost: l.TokenTime}}}
				if ok, err := s.Take(ctx, time.Now(), d); err != nil || !ok {
					t.Errorf("key %d: %v, %v", i, ok, err)
					return
				}
			}
		})
	}
	wg.Wait()
	took := time.Since(start)
	grown := used() - before
	var samples []string
	for i := 0; i < n; i += n/5 + 1 {
		hash, _ := s.BucketName(0, ipKey(ip(i)))
		mu, _ := c.MemoryUsage(ctx, hash, 0).Result()
		hl, _ := c.HLen(ctx, hash).Result()
		samples = append(samples, fmt.Sprintf("%d B / %d = %.1f", mu, hl, float64(mu)/float64(hl)))
	}
	hashes, _ := c.DBSize(ctx).Result()
	t.Logf("%d buckets through the store in %v, in %d hashes: used_memory +%d B, %.1f B per bucket", n, took.Round(time.Millisecond), hashes, grown, float64(grown)/float64(n))
	t.Logf("MEMORY USAGE of sample hashes, per bucket: %s", strings.Join(samples, "; "))
	if hash, field := s.BucketName(0, ipKey(ip(n-1))); !c.HExists(ctx, hash, field).Val() {
		t.Fatal("the last bucket is not in Redis")
	}
	if per := float64(grown) / float64(n); per > 100 {
		t.Errorf("%.1f B per bucket in Redis, more than 100", per)
	}

	// The layout before, for the same keys: `t:rb:{<ip>}` holding the
	// instant as Redis writes a Lua number, expiring with PX.
	const old = `local t = redis.call('TIME')
		local now = (t[1] - 1735689600) * 1000000 + t[2]
		for i = tonumber(ARGV[1]), tonumber(ARGV[2]) do
			local key = string.format('t:rb:{10.%d.%d.%d}', math.floor(i / 65536) % 256, math.floor(i / 256) % 256, i % 256)
			redis.call('SET', key, now + 3600000000 / 7, 'PX', 514286)
		end`
	before = used()
	for i := 0; i < n; i += 10_000 {
		if err := c.Eval(ctx, old, nil, i, min(i+10_000, n)-1).Err(); err != nil && err != redis.Nil {
			t.Fatal(err)
		}
	}
	grownOld := used() - before
	mu, _ := c.MemoryUsage(ctx, "t:rb:{"+ip(n/2)+"}", 0).Result()
	t.Logf("the layout before, same keys: used_memory +%d B, %.1f B per bucket; MEMORY USAGE of one key %d B", grownOld, float64(grownOld)/float64(n), mu)
}

// BenchmarkTake is one decision through the store, one caller at a time,
// on keys that never run out: its latency and allocations. The
// comparison with redis_rate at 1 to 64 callers is in bench/compare.
func BenchmarkTake(b *testing.B) {
	r := redistest.Start(b)
	plain := gcra.NewLimit(1e6, 1e6)
	for _, tc := range []struct {
		name  string
		shape func(l *gcra.Limit)
		quota bool
	}{
		{"plain", func(*gcra.Limit) {}, false},
		{"ban", func(l *gcra.Limit) { l.Ban = 15 * time.Minute }, false},
		{"delay", func(l *gcra.Limit) { l.Delay = time.Second }, false},
		{"quota", func(*gcra.Limit) {}, true},
	} {
		b.Run(tc.name, func(b *testing.B) {
			l := plain
			tc.shape(&l)
			zone := redisstore.Bucket("rb-"+tc.name, l)
			months := &calendar.Windows{Period: calendar.Periods["month"], Loc: time.UTC}
			if tc.quota {
				zone.Quota = "month@UTC"
			}
			s := redisstore.Open(b, redisstore.OpenClient(b, r.Addr()), []store.ZoneSpec{zone}, redisstore.Options{KeyPrefix: "rl:"}) // the module's
			keys := make([]store.Key, 10000)
			for i := range keys {
				keys[i] = store.Key{Text: "k" + strconv.Itoa(i)}
			}
			calls := r.Calls()
			b.ReportAllocs()
			i := 0
			var d store.Demands
			for b.Loop() {
				k := keys[i%len(keys)]
				d.Buckets = append(d.Buckets[:0], store.BucketDemand{Key: k, Limit: l, Cost: l.TokenTime})
				d.Counters = d.Counters[:0]
				if tc.quota {
					d.Counters = append(d.Counters, store.CounterDemand{Key: k, Limit: 999999999999999, Cost: 1, Window: months.Window(time.Now())})
				}
				if _, err := s.Take(context.Background(), time.Now(), &d); err != nil {
					b.Fatal(err)
				}
				i++
			}
			b.ReportMetric(float64(r.Calls()-calls)/float64(i), "calls/op")
		})
	}
}

// A store keeps its client while a request holds it, after its maker let
// go of it: the last to let go gives the client back, once, and a
// request that comes later finds the store let go of.
func TestHoldersKeepTheClient(t *testing.T) {
	r := redistest.Start(t)
	given := 0
	s, err := redisstore.New(redisstore.OpenClient(t, r.Addr()), []store.ZoneSpec{redisstore.Bucket("held", redisstore.PerMinute(5))},
		redisstore.Options{FailMode: "open", CallTimeout: time.Second, GiveBack: func() error { given++; return nil }})
	if err != nil {
		t.Fatal(err)
	}
	if got := s.FailureMode(); got != store.FailOpen {
		t.Errorf("fail mode %v, want open", got)
	}
	if !s.Hold() {
		t.Fatal("a request could not hold a store in use")
	}
	if err := s.Drop(); err != nil || given != 0 {
		t.Fatalf("the maker let go under a request: %v, the client given back %d times", err, given)
	}
	s.Done()
	if given != 1 {
		t.Fatalf("the last request let go: the client given back %d times, want once", given)
	}
	if s.Hold() {
		t.Fatal("a request held a store that was let go of")
	}
}

// A reset deletes a key's bucket and its quota counters, the counter of
// builds before the counters' tag too, and what the over-limit cache knew
// of them: the key's next request is allowed at once. It reports whether
// there was anything to delete.
func TestReset(t *testing.T) {
	r := redistest.Start(t)
	l := redisstore.PerMinute(1)
	zone := redisstore.Bucket("reset", l)
	zone.Quota = "day@UTC"
	s := redisstore.Open(t, redisstore.OpenClient(t, r.Addr()), []store.ZoneSpec{zone}, redisstore.Options{})
	days := &calendar.Windows{Period: calendar.Periods["day"], Loc: time.UTC}
	demands := func() *store.Demands {
		d := redisstore.TakeOf(0, "k", l)
		d.Counters = []store.CounterDemand{{Key: store.Key{Text: "k"}, Limit: 1, Cost: 1, Window: days.Window(time.Now())}}
		return d
	}
	ctx := context.Background()
	for i, want := range []bool{true, false, false} { // the second refused by Redis, the third by the cache
		if ok, err := s.Take(ctx, time.Now(), demands()); ok != want || err != nil {
			t.Fatalf("request %d: %v, %v; want %v", i, ok, err, want)
		}
	}
	if found, err := s.Reset(ctx, demands()); !found || err != nil {
		t.Fatalf("reset: %v, %v; want found", found, err)
	}
	if n := r.CLI("DBSIZE"); n != "0" {
		t.Errorf("%s keys left after the reset", n)
	}
	if ok, err := s.Take(ctx, time.Now(), demands()); !ok || err != nil {
		t.Fatalf("after the reset: %v, %v", ok, err)
	}
	if found, err := s.Reset(ctx, &store.Demands{Buckets: []store.BucketDemand{{Key: store.Key{Text: "none"}, Limit: l}}}); found || err != nil {
		t.Fatalf("reset of a full bucket: %v, %v; want nothing found", found, err)
	}
}

// Keys' own limits are read back as they were set, listed with their
// keys while they last, and counted; a zone keeps no more than its
// max_overrides, and one that ends by itself is gone from Redis.
func TestOverrides(t *testing.T) {
	r := redistest.Start(t)
	zone := redisstore.Bucket("own", redisstore.PerMinute(2))
	zone.MaxOverrides = 3
	s := redisstore.Open(t, redisstore.OpenClient(t, r.Addr()), []store.ZoneSpec{zone}, redisstore.Options{})
	ctx := context.Background()
	now := time.Now()
	brief := store.Override{TokenTime: time.Second, Burst: 5, Rate: "1r/s", Expires: now.Add(300 * time.Millisecond)}
	for key, o := range map[string]store.Override{
		"a": {TokenTime: time.Second, Burst: 10, Rate: "1r/s"},
		"b": {TokenTime: time.Minute, Burst: 3, Rate: "1r/m"},
		"c": brief,
	} {
		if err := s.SetOverride(ctx, now, 0, store.Key{Text: key}, o); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.SetOverride(ctx, now, 0, store.Key{Text: "d"}, brief); !errors.Is(err, store.ErrTooManyOverrides) {
		t.Fatalf("a fourth override of a zone of 3: %v, want %v", err, store.ErrTooManyOverrides)
	}
	o, found, err := s.Override(ctx, 0, store.Key{Text: "c"})
	if err != nil || !found || o.Burst != 5 || o.Rate != "1r/s" || o.Expires.Sub(brief.Expires).Abs() > 50*time.Millisecond {
		t.Fatalf("override of c: %+v, %v, %v; want %+v", o, found, err, brief)
	}
	list, err := s.Overrides(ctx, 0)
	if err != nil {
		t.Fatal(err)
	}
	var keys []string
	for _, ko := range list {
		keys = append(keys, ko.Key)
	}
	slices.Sort(keys)
	if fmt.Sprint(keys) != "[a b c]" {
		t.Fatalf("listed %v, want a, b and c", keys)
	}
	time.Sleep(400 * time.Millisecond) // c's end
	if n, err := s.OverrideCount(ctx, 0); n != 2 || err != nil {
		t.Fatalf("%d overrides counted, %v; want 2 after c's end", n, err)
	}
	if _, found, _ := s.Override(ctx, 0, store.Key{Text: "c"}); found {
		t.Fatal("c's override is read after its end")
	}
	if found, err := s.DeleteOverride(ctx, now, 0, store.Key{Text: "a"}); !found || err != nil {
		t.Fatalf("removing a's: %v, %v", found, err)
	}
	if list, _ := s.Overrides(ctx, 0); len(list) != 1 || list[0].Key != "b" || list[0].Override.Burst != 3 {
		t.Fatalf("listed %+v, want b's alone", list)
	}
}
