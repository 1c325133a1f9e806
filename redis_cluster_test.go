// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/redistest"
)

// A master of a Redis Cluster killed under load, with two Caddy
// instances sharing a zone of 1r/m burst 5 and one with sync 100ms:
// every request is answered, none with a 5xx (fail_mode local decides
// what the cluster cannot), and within 5 s of the cluster serving every
// slot again (the master's replica took over) the instances share exact
// limits again: a fresh key sent 8 requests alternately to both is
// allowed 5, and 6 at most with sync (its bound, (2 − 1) × (r × T + 1)).
func TestRedisClusterFailover(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs Caddy")
	}
	masters, replicas := redistest.StartReplicatedCluster(t)
	bin, _ := buildCaddy(t)
	var addrs []string
	for _, n := range append(slices.Clone(masters), replicas...) {
		addrs = append(addrs, n.Addr())
	}
	// A timeout of a second, so that a machine loaded by other work does
	// not make a healthy master's call fail_mode's.
	site := fmt.Sprintf(`	rate_limit {
		zone exact {
			key {http.request.header.X-Key}
			match not path /sync
			rate 1r/m
			burst 5
		}
		zone synced {
			key {http.request.header.X-Key}
			match path /sync
			rate 1r/m
			burst 5
			sync 100ms
		}
		store redis {
			address %s
			key_prefix failover:
			timeout 1s
			fail_mode local
		}
	}
	respond "ok"`, strings.Join(addrs, " "))
	instances := []*faultCaddy{startCaddyProcess(t, bin, site), startCaddyProcess(t, bin, site)}
	client := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: 32}}
	served := newTally()

	// allowed sends each of n fresh keys 8 requests to path, alternately
	// to both instances (the keys at once, a key's requests in turn), and
	// counts what each key was allowed.
	var fresh atomic.Int64
	allowed := func(path string, n int) []int {
		got := make([]int, n)
		var wg sync.WaitGroup
		for k := range got {
			key := fmt.Sprintf("fresh-%d", fresh.Add(1))
			wg.Go(func() {
				for i := range 8 {
					rep := send(client, instances[i%2].url+path, "X-Key", key)
					served.note(rep)
					if rep.status == http.StatusOK {
						got[k]++
					}
				}
			})
		}
		wg.Wait()
		return got
	}
	exact := func(got []int, most int) bool {
		for _, n := range got {
			if n < 5 || n > most {
				return false
			}
		}
		return true
	}
	if got := allowed("/", 10); !exact(got, 5) {
		t.Fatalf("before the failover, fresh keys were allowed %v of 8, want 5 each", got)
	}

	// The load: 8 clients on 40 keys, alternately to both instances and
	// both zones, from before the kill to the end.
	stop := make(chan struct{})
	wait := loop(8, 2*time.Millisecond, stop, func(c, i int) {
		path := []string{"/", "/sync"}[i/2%2]
		served.note(send(client, instances[i%2].url+path, "X-Key", fmt.Sprintf("load-%d", (5*c+i)%40)))
	})
	var stopped sync.Once
	stopLoad := func() { stopped.Do(func() { close(stop); wait() }) }
	defer stopLoad()
	time.Sleep(time.Second)

	victim, heir := masters[0], replicas[0]
	victim.Kill()
	killed := time.Now()
	waitFor(t, 20*time.Second, "the replica to take over", func() bool {
		if strings.Fields(heir.CLI("ROLE"))[0] != "master" {
			return false
		}
		for _, n := range append(slices.Clone(masters[1:]), replicas...) {
			if !n.ClusterOK() {
				return false
			}
		}
		return true
	})
	ok := time.Now()
	t.Logf("cluster_state:ok on every node %v after the kill", ok.Sub(killed).Round(time.Millisecond))

	// Until 5 s after, batches of fresh keys say when the limits are exact
	// again (logged); from then on every fresh key's must be.
	var since time.Duration = -1
	for time.Since(ok) < 5*time.Second {
		at := time.Since(ok)
		if got := allowed("/", 10); !exact(got, 5) {
			since = -1
			t.Logf("%v after cluster_state:ok, 10 fresh keys allowed %v of 8", at.Round(time.Millisecond), got)
		} else if since < 0 {
			since = at
		}
		time.Sleep(200 * time.Millisecond)
	}
	if since >= 0 {
		t.Logf("every batch of 10 fresh keys exact from %v after cluster_state:ok", since.Round(time.Millisecond))
	}
	if got := allowed("/", 20); !exact(got, 5) {
		t.Errorf("5 s after cluster_state:ok, fresh keys were allowed %v of 8, want 5 each", got)
	}
	if got := allowed("/sync", 20); !exact(got, 6) {
		t.Errorf("5 s after cluster_state:ok, fresh keys of the zone with sync were allowed %v of 8, want 5 or 6 each", got)
	}

	stopLoad()
	t.Logf("responses: %v, %d without one (%v)", served.codes, served.errs, served.firstErr)
	if served.errs > 0 {
		t.Errorf("%d requests got no response: %v", served.errs, served.firstErr)
	}
	for code, n := range served.codes {
		if code != http.StatusOK && code != http.StatusTooManyRequests {
			t.Errorf("%d requests answered %d", n, code)
		}
	}
}
