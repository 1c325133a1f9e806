// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package main

import (
	"encoding/json"
	"fmt"
	"io"
	"log"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"time"
)

// The memory comparison: Caddy's resident memory after it has seen many
// distinct keys, once per request each, with our local store and with
// caddy-ratelimit's equivalent zone.

// keysLua makes wrk send each request with a new X-Key, and stop once
// the given number of answers have come back.
// (wrk's main thread sleeps for the whole -d duration even when its
// threads stop, so the script writes a file that tells the harness to
// interrupt wrk.)
const keysLua = `-- X-Key: key-1, key-2, ... one per request. After args[1] answers,
-- stop and create the file args[2].
local n, done, limit, marker = 0, 0, 0, nil
function init(args)
	limit, marker = tonumber(args[1]), args[2]
end
function request()
	n = n + 1
	return wrk.format("GET", "/", { ["X-Key"] = "key-" .. n })
end
function response(status, headers, body)
	done = done + 1
	if done == limit then
		local f = io.open(marker, "w")
		f:write("done\n")
		f:close()
		wrk.thread:stop()
	end
end
`

type memResult struct {
	Impl, Config      string
	Keys              int64 // distinct keys sent
	Non2xx            int64
	RSSIdle, RSSAfter int64 // kB, each after a forced GC
	HWM               int64 // kB, VmHWM: the peak
	HeapIdle, Heap    int64 // bytes of Go heap in use (memstats.HeapInuse) before and after
	Seconds           float64
}

func (m memResult) perKey() float64 {
	return float64(m.RSSAfter-m.RSSIdle) * 1024 / float64(max(m.Keys, 1))
}

func (m memResult) heapPerKey() float64 {
	return float64(m.Heap-m.HeapIdle) / float64(max(m.Keys, 1))
}

func (e *env) runMemory() ([]*memResult, noise, error) {
	script := filepath.Join(e.tmp, "keys.lua")
	if err := os.WriteFile(script, []byte(keysLua), 0o644); err != nil {
		return nil, noise{}, err
	}
	zone := "rate_limit {\n\tzone mem {\n\t\tkey {http.request.header.X-Key}\n\t\t%s\n\t}\n}\nrespond \"ok\""
	// caddy-ratelimit drops idle keys once a minute by default: a longer
	// interval keeps that from happening in the middle of a measurement.
	peerZone := "rate_limit {\n\tzone mem {\n\t\tkey {http.request.header.X-Key}\n\t\t%s\n\t}\n\tsweep_interval 10m\n}\nrespond \"ok\""
	specs := []struct {
		impl, config string
		spec         caddySpec
	}{
		{"rate_limit local", "`rate 10r/s`, `burst 10`, default `max_keys` (1M)",
			caddySpec{name: "mem-ours", bin: e.caddyBin, admin: true, site: fmt.Sprintf(zone, "rate 10r/s\n\t\tburst 10")}},
		{"caddy-ratelimit v0.1.0", "`events 10`, `window 1s`; `sweep_interval 10m`",
			caddySpec{name: "mem-peer", bin: e.peerBin, admin: true, site: fmt.Sprintf(peerZone, "events 10\n\t\twindow 1s")}},
	}
	m := meter()
	var out []*memResult
	for i, s := range specs {
		if i > 0 {
			time.Sleep(e.p.pause)
		}
		r, err := e.memOnce(s.spec, script)
		if err != nil {
			return nil, noise{}, err
		}
		r.Impl, r.Config = s.impl, s.config
		log.Printf("  %-22s %d keys in %.0fs: RSS %d -> %d MiB (peak %d MiB), %.0f B/key RSS, %.0f B/key heap",
			r.Impl, r.Keys, r.Seconds, r.RSSIdle>>10, r.RSSAfter>>10, r.HWM>>10, r.perKey(), r.heapPerKey())
		out = append(out, r)
	}
	return out, m.since(), nil
}

func (e *env) memOnce(spec caddySpec, script string) (*memResult, error) {
	c, err := e.startCaddy(spec)
	if err != nil {
		return nil, err
	}
	defer c.stop()
	if err := expect(c, map[string]string{"X-Key": "check"}, 200); err != nil {
		return nil, err
	}
	r := &memResult{}
	if r.RSSIdle, r.HeapIdle, err = settledMemory(c); err != nil {
		return nil, err
	}
	t := time.Now()
	// The duration is only a bound: the script stops wrk after the keys.
	marker := filepath.Join(e.tmp, spec.name+".done")
	w, err := e.runWrkUntil(spec.name, c.url, e.p.memBound, marker, script, strconv.Itoa(e.p.keys), marker)
	if err != nil {
		return nil, err
	}
	r.Seconds = time.Since(t).Seconds()
	r.Keys, r.Non2xx = w.Requests, w.Non2xx
	if w.Requests < int64(e.p.keys) {
		return nil, fmt.Errorf("%s: only %d of %d keys sent within %v", spec.name, w.Requests, e.p.keys, e.p.memBound)
	}
	if r.RSSAfter, r.Heap, err = settledMemory(c); err != nil {
		return nil, err
	}
	if r.HWM, err = procStatusKB(c.proc.pid(), "VmHWM"); err != nil {
		return nil, err
	}
	return r, nil
}

// settledMemory forces a garbage collection through Caddy's admin API
// (the heap profile with gc=1), lets the runtime return what it can, and
// reads VmRSS and the Go heap in use.
func settledMemory(c *caddyInst) (rssKB, heapInuse int64, err error) {
	client := http.Client{Timeout: 30 * time.Second}
	for range 2 {
		resp, err := client.Get("http://" + c.admin + "/debug/pprof/heap?gc=1")
		if err != nil {
			return 0, 0, fmt.Errorf("forcing a GC: %w", err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		time.Sleep(time.Second)
	}
	if rssKB, err = procStatusKB(c.proc.pid(), "VmRSS"); err != nil {
		return 0, 0, err
	}
	resp, err := client.Get("http://" + c.admin + "/debug/vars")
	if err != nil {
		return 0, 0, err
	}
	defer resp.Body.Close()
	var vars struct {
		Memstats struct {
			HeapInuse int64
		} `json:"memstats"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&vars); err != nil {
		return 0, 0, fmt.Errorf("/debug/vars: %w", err)
	}
	return rssKB, vars.Memstats.HeapInuse, nil
}
