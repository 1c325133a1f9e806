// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"context"
	_ "embed"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/redisstore"
	"github.com/caddy-tokenbucket/ratelimit/internal/rediswire"
	"github.com/caddy-tokenbucket/ratelimit/internal/store"
	"github.com/caddy-tokenbucket/ratelimit/lua"
	"github.com/redis/go-redis/v9"
)

// The zones of the flight tests: plain buckets (a, and c of two tokens a
// request), a ban (e), a quota alone (q), a zone whose limit comes with
// each request (p), and one with keys of their own limit (v).
const flightZones = `[
	{"name":"a","rate":"10r/s","burst":3},
	{"name":"c","rate":"2r/s","burst":4,"cost":2},
	{"name":"e","rate":"1r/s","burst":2,"ban":"2s"},
	{"name":"q","quota":5,"quota_period":"day"},
	{"name":"p","rate":"{http.vars.rate}","burst":"{http.vars.burst}"},
	{"name":"v","rate":"5r/s","burst":4,"max_overrides":10}]`

// A flight request: the zones it matches (an upper-case letter is the
// zone's quota), its key, and its plan in zone p.
type flightReq struct {
	zones, key, plan string
}

// flightDemands are r's demands, as decide makes them.
func flightDemands(zones map[byte]*Zone, now time.Time, r flightReq) (*store.Demands, error) {
	d := new(store.Demands)
	k := store.Key{Text: r.key}
	for _, c := range []byte(r.zones) {
		if c >= 'A' && c <= 'Z' {
			d.Counters = append(d.Counters, counterReq(zones[c-'A'+'a'], k, now))
			continue
		}
		z := zones[c]
		b := bucketReq(z, k)
		if z.plans != nil {
			p, err := z.parsePlan(planValues[r.plan])
			if err != nil {
				return nil, err
			}
			b.Limit, b.Cost = p.limit, p.costTime
		}
		d.Buckets = append(d.Buckets, b)
	}
	return d, nil
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

// stepZonesOf maps each of h's zones by its name's last letter, with its
// quota's windows stepQuotaWindow long.
func stepZonesOf(h *Handler) map[byte]*Zone {
	zones := map[byte]*Zone{}
	for _, z := range h.Zones {
		zones[z.Name[len(z.Name)-1]] = z
		if z.quota != nil {
			z.quota.Every = stepQuotaWindow
		}
	}
	return zones
}

// The decisions of a flight, sent to Redis in one script call, are each
// what it would be alone, one after another: requests of every kind of
// zone, in flights of 1 to 40 at one instant (with runs of one request
// repeated), get from Redis what the local store answers them one by
// one.
func TestRedisFlightMatchesLocal(t *testing.T) {
	r := startRedis(t)
	local := newTestHandler(t, `{"zones":`+strings.ReplaceAll(flightZones, `"name":"`, `"name":"fl-`)+`}`)
	remote := newTestHandler(t, fmt.Sprintf(`{"zones":%s,"store":{"backend":"redis","addresses":[%q],"timeout":"5s","key_prefix":"flight:","disable_over_limit_cache":true}}`,
		flightZones, r.Addr()))
	rs := remote.store.(*redisstore.Store)
	var now time.Time
	rs.TestClock = func() time.Time { return now }
	lz, rz := stepZonesOf(local), stepZonesOf(remote)
	now = time.Unix(time.Now().Add(stepQuotaWindow).Unix()/100*100, 0)
	ctx := context.Background()

	// Key o1 has its own limit in v on both stores.
	burst := int64(2)
	for _, h := range []*Handler{local, remote} {
		z := stepZonesOf(h)['v']
		o, err := z.overrideOf(limitBody{Rate: "1r/s", Burst: &burst}, now)
		if err == nil {
			err = h.store.SetOverride(ctx, now, z.index, store.Key{Text: "o1"}, o)
		}
		if err != nil {
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
			var err error
			if ds[i], err = flightDemands(rz, now, q); err != nil {
				t.Fatal(err)
			}
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
			d, err := flightDemands(lz, now, q)
			if err != nil {
				t.Fatal(err)
			}
			ok, err := local.store.Take(ctx, now, d)
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
func TestRedisClusterFlight(t *testing.T) {
	nodes := startCluster(t)
	h := newTestHandler(t, fmt.Sprintf(`{"zones":[{"name":"cf","rate":"1r/m","burst":4}],
		"store":{"backend":"redis","addresses":[%q,%q,%q],"timeout":"5s","disable_over_limit_cache":true}}`,
		nodes[0].Addr(), nodes[1].Addr(), nodes[2].Addr()))
	rs, z := h.store.(*redisstore.Store), h.Zones[0]
	var ds []*store.Demands
	tags := map[string]bool{}
	for i := range 60 {
		k := z.keyFor(fmt.Sprint("192.0.2.", i%12))
		ds = append(ds, &store.Demands{Buckets: []store.BucketDemand{bucketReq(z, k)}})
		hash, _ := rs.Keys.Bucket(rs.Zones[z.index].Field, k.String())
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
		c, _ := evalStats(t, n)
		before += c
	}
	allowed, errs := rs.RunAll(rediswire.Take, ds)
	var after int64
	for _, n := range nodes {
		c, _ := evalStats(t, n)
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
func TestRedisUpgradeFromBeforeFlights(t *testing.T) {
	r := startRedis(t)
	zones := `[{"name":"up","rate":"4r/s","burst":3},{"name":"upban","rate":"2r/s","burst":2,"ban":"1s"}]`
	open := func(prefix string) (*Handler, *redisstore.Store) {
		h := newTestHandler(t, fmt.Sprintf(`{"zones":%s,"store":{"backend":"redis","addresses":[%q],"timeout":"5s","key_prefix":%q,"disable_over_limit_cache":true}}`,
			zones, r.Addr(), prefix))
		return h, h.store.(*redisstore.Store)
	}
	hm, mixed := open("up-mixed:")
	hb, before := open("up-before:")
	var now time.Time
	mixed.TestClock = func() time.Time { return now }
	old := redis.NewScript(beforeFlightsLua)
	c := newRedisClient(t, r.Addr())
	ctx := context.Background()
	// takeBefore decides d's one bucket by the script before flights.
	takeBefore := func(s *redisstore.Store, d *store.Demands) (bool, time.Duration) {
		b := &d.Buckets[0]
		hash, field, limit := s.Keys.BucketLimit(s.Zones[b.Zone].Field, b.Key.String())
		sh := s.ShapeOf(b, false)
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
		demand := func(h *Handler) *store.Demands {
			return &store.Demands{Buckets: []store.BucketDemand{bucketReq(h.Zones[zi], key)}}
		}
		wantOK, wantDebt := takeBefore(before, demand(hb))
		d := demand(hm)
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
