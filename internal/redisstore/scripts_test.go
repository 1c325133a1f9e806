// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package redisstore_test

import (
	"bufio"
	"context"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/calendar"
	"github.com/caddy-tokenbucket/ratelimit/internal/gcra"
	"github.com/caddy-tokenbucket/ratelimit/internal/redisstore"
	"github.com/caddy-tokenbucket/ratelimit/internal/redistest"
	"github.com/caddy-tokenbucket/ratelimit/internal/store"
)

// Every key a script touches is among its call's KEYS (Redis's EVAL
// contract, on which Cluster routing relies and which Dragonfly
// enforces): MONITOR shows each script call with its keys, then the
// commands the script ran, while a store decides every kind of zone.
func TestScriptsDeclareTheirKeys(t *testing.T) {
	r := redistest.Start(t)
	mon := exec.Command(redistest.CLIBin(), "-p", strconv.Itoa(r.Port), "MONITOR")
	out, err := mon.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := mon.Start(); err != nil {
		t.Fatal(err)
	}
	lines := make(chan []string, 1)
	go func() {
		var all []string
		sc := bufio.NewScanner(out)
		sc.Buffer(nil, 1<<20)
		for sc.Scan() {
			all = append(all, sc.Text())
		}
		lines <- all
	}()
	time.Sleep(100 * time.Millisecond) // MONITOR is on

	everyKind(t, r.Addr())

	time.Sleep(100 * time.Millisecond)
	_ = mon.Process.Kill()
	_ = mon.Wait()
	var keys map[string]bool // the current call's
	ran := map[string]int{}
	calls := 0
	for _, line := range <-lines {
		args, src := monitorLine(t, line)
		switch {
		case len(args) == 0:
		case strings.EqualFold(args[0], "EVALSHA") || strings.EqualFold(args[0], "EVAL"):
			n, _ := strconv.Atoi(args[2])
			keys = map[string]bool{}
			for _, k := range args[3 : 3+n] {
				keys[k] = true
			}
			calls++
		case src == "lua" && args[0] != "TIME":
			ran[args[0]]++
			if !keys[args[1]] {
				t.Errorf("%s ran on %q, not among the call's KEYS %v", args[0], args[1], keys)
			}
		}
	}
	t.Logf("%d script calls, their commands: %v", calls, ran)
	// (PTTL runs on Redis 6.2 alone, which lacks PEXPIRE's NX and GT.)
	for _, cmd := range []string{"GET", "HGET", "HSET", "HDEL", "HRANDFIELD", "PEXPIRE", "HMGET", "PEXPIREAT",
		"ZREMRANGEBYSCORE", "ZCARD", "ZADD", "ZRANGE", "ZREM", "TYPE", "ZCOUNT", "ZSCORE", "SET", "DEL"} {
		if ran[cmd] == 0 {
			t.Errorf("no script ran %s: the test does not reach every part of the scripts", cmd)
		}
	}
}

// everyKind has stores of the Redis at addr decide every kind of zone as
// a handler's requests of one client would have them decided: keys with
// their own limit set, then one removed; four requests of every zone, the
// first holding its slots while each zone's state is read (as the admin
// API reads a key), each giving its slots back and the tokens of the
// zone that counts only some responses; a flood of one key, many takes
// in one call.
func everyKind(t *testing.T, addr string) {
	ban, delay, plan := redisstore.PerMinute(1), redisstore.PerMinute(1), gcra.NewLimit(2.0/60, 2)
	ban.Ban, delay.Delay = time.Hour, 10*time.Millisecond
	limits := []gcra.Limit{redisstore.PerMinute(3), ban, delay, {}, {}, plan, redisstore.PerMinute(2), {}}
	rateless := gcra.NewLimit(1, 1)
	zones := []store.ZoneSpec{
		redisstore.Bucket("mon_a", limits[0]),
		redisstore.Bucket("mon_b", limits[1]),
		redisstore.Bucket("mon_d", limits[2]),
		{Name: "mon_q", Shape: rateless, Quota: "day@UTC", MaxOverrides: store.DefaultMaxOverrides},
		{Name: "mon_k", Shape: rateless, Slots: true, MaxOverrides: store.DefaultMaxOverrides},
		{Name: "mon_p", Bucket: true, MaxOverrides: store.DefaultMaxOverrides}, // its limit comes with each request
		{Name: "mon_n", Bucket: true, Shape: limits[6], Refunds: true, MaxOverrides: store.DefaultMaxOverrides},
		{Name: "mon_s", Shape: rateless, Slots: true, MaxOverrides: store.DefaultMaxOverrides},
	}
	const slotsK, slotsS = 2, 1
	s := redisstore.Open(t, redisstore.OpenClient(t, addr), zones, redisstore.Options{KeyPrefix: "mon:"})
	ctx := context.Background()
	key := ipKey("192.0.2.9")
	days := &calendar.Windows{Period: calendar.Periods["day"], Loc: time.UTC}
	// zoneDemands are zone i's demands of key, as a request makes them
	// (with limit l for a zone whose limit comes with each request).
	zoneDemands := func(i int, l gcra.Limit, d *store.Demands) {
		switch i {
		case 3:
			d.Counters = append(d.Counters, store.CounterDemand{Zone: i, Key: key, Limit: 2, Cost: 1, Window: days.Window(time.Now())})
		case 4, 7:
			d.Slots = append(d.Slots, store.SlotDemand{Zone: i, Key: key, Limit: map[int]int64{4: slotsK, 7: slotsS}[i], Lease: time.Minute, Soft: i == 7})
		default:
			d.Buckets = append(d.Buckets, store.BucketDemand{Zone: i, Key: key, Limit: l, Cost: l.TokenTime})
		}
	}
	// Keys with their own limit: the script reads and writes their
	// buckets under it, beside the others.
	for _, i := range []int{0, 5} {
		o := store.Override{TokenTime: 30 * time.Second, Burst: 4, Rate: "2r/m"}
		if err := s.SetOverride(ctx, time.Now(), i, key, o); err != nil {
			t.Fatal(err)
		}
	}
	// unknownPlan is how a key of a zone whose limit comes with each
	// request is read outside of one: a limit that clamps nothing.
	unknownPlan := gcra.Limit{TokenTime: gcra.MaxBurstTime, BurstTime: gcra.MaxBurstTime, Burst: 1}
	for req := range 4 {
		d := new(store.Demands)
		for i, l := range limits {
			zoneDemands(i, l, d)
		}
		if _, err := s.Take(ctx, time.Now(), d); err != nil {
			t.Fatal(err)
		}
		if req == 0 {
			// While the first request holds its slots, every zone's state.
			for i, l := range limits {
				if i == 5 {
					l = unknownPlan
				}
				var view store.Demands
				zoneDemands(i, l, &view)
				if err := s.Peek(ctx, time.Now(), &view); err != nil {
					t.Errorf("reading zone %d: %v", i, err)
				}
			}
		}
		// The response, a 200, is not one that mon_n counts: its tokens
		// go back; the slots too.
		refund := &store.Demands{Buckets: []store.BucketDemand{{Zone: 6, Key: key, Limit: limits[6], Cost: -limits[6].TokenTime}}}
		if err := s.Adjust(ctx, time.Now(), refund); err != nil {
			t.Fatal(err)
		}
		if err := s.Release(ctx, d.Slots); err != nil {
			t.Fatal(err)
		}
	}
	// A flood of one key: many takes in one call.
	l := redisstore.PerMinute(5)
	flood := redisstore.Open(t, redisstore.OpenClient(t, addr), []store.ZoneSpec{redisstore.Bucket("mon_f", l)},
		redisstore.Options{KeyPrefix: "mon:", DisableOverLimitCache: true})
	var wg sync.WaitGroup
	for range 64 {
		wg.Go(func() { _, _ = flood.Take(ctx, time.Now(), redisstore.TakeOf(0, "192.0.2.10", l)) })
	}
	wg.Wait()
	// A key's own limit removed, with its place in the zone's list.
	if _, err := s.DeleteOverride(ctx, time.Now(), 0, key); err != nil {
		t.Fatal(err)
	}
}

// monitorLine reads a line of MONITOR: `<time> [<db> <source>] "<cmd>"
// "<arg>"...`, each quoted as redis-cli quotes it.
func monitorLine(t *testing.T, line string) (args []string, source string) {
	open, end := strings.IndexByte(line, '['), strings.IndexByte(line, ']')
	if open < 0 || end < open {
		return nil, ""
	}
	if f := strings.Fields(line[open+1 : end]); len(f) == 2 {
		source = f[1]
	}
	rest := line[end+1:]
	for {
		i := strings.IndexByte(rest, '"')
		if i < 0 {
			return args, source
		}
		j := i + 1
		for j < len(rest) && rest[j] != '"' {
			if rest[j] == '\\' {
				j++
			}
			j++
		}
		s, err := strconv.Unquote(rest[i : j+1])
		if err != nil {
			t.Fatalf("MONITOR line %q: %v", line, err)
		}
		args = append(args, s)
		rest = rest[j+1:]
	}
}
