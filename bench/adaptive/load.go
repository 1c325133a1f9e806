// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package main

import (
	"encoding/json"
	"io"
	"net/http"
	"sync"
	"time"
)

// A request is one that a client sent, in times since the run's start.
type request struct {
	sent, done time.Duration
	status     int  // 0: no response
	critical   bool // sent by a critical client (X-Priority: critical)
}

func (r request) latency() time.Duration { return r.done - r.sent }

// load is how the clients behave in a run.
type load struct {
	clients int
	length  time.Duration
	// fallAt: from then on, only fallTo clients go on (0: never).
	fallAt time.Duration
	fallTo int
	// backoff: a client whose request was refused waits this long before
	// the next.
	backoff time.Duration
	// critical clients send `X-Priority: critical`, each its next request
	// think after the last answer, whatever it was, beside the others
	// (which send no class: the lowest).
	critical int
	think    time.Duration
}

// drive runs the closed-loop clients against url: each sends a request,
// waits for the whole response, and sends the next.
func drive(url string, l load, start time.Time) []request {
	tr := &http.Transport{MaxIdleConnsPerHost: 1024, DisableCompression: true}
	defer tr.CloseIdleConnections()
	client := &http.Client{Transport: tr, Timeout: 30 * time.Second}
	out := make([][]request, l.clients+l.critical)
	var wg sync.WaitGroup
	for i := range l.clients + l.critical {
		critical := i >= l.clients
		wg.Go(func() {
			for {
				at := time.Since(start)
				if at >= l.length || l.fallAt > 0 && at >= l.fallAt && i >= l.fallTo && !critical {
					return
				}
				r := send(client, url, start, critical)
				out[i] = append(out[i], r)
				switch {
				case critical:
					time.Sleep(l.think)
				case r.status != http.StatusOK && l.backoff > 0:
					time.Sleep(l.backoff)
				}
			}
		})
	}
	wg.Wait()
	var all []request
	for _, rs := range out {
		all = append(all, rs...)
	}
	return all
}

func send(client *http.Client, url string, start time.Time, critical bool) request {
	r := request{sent: time.Since(start), critical: critical}
	req, err := http.NewRequest(http.MethodGet, url, nil)
	if err != nil {
		panic(err)
	}
	if critical {
		req.Header.Set("X-Priority", "critical")
	}
	resp, err := client.Do(req)
	if err == nil {
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		r.status = resp.StatusCode
	}
	r.done = time.Since(start)
	return r
}

// A sample is the adaptive limit's state, as the admin API showed it.
type sample struct {
	at              time.Duration
	limit, inFlight float64
	latency, noLoad float64 // seconds
}

// watch reads the key's adaptive state from the admin API every period
// until stop is closed.
func watch(admin string, start time.Time, period time.Duration, stop <-chan struct{}) []sample {
	client := &http.Client{Timeout: time.Second}
	url := "http://" + admin + "/rate_limit/backend/static"
	var out []sample
	t := time.NewTicker(period)
	defer t.Stop()
	for {
		select {
		case <-stop:
			return out
		case <-t.C:
		}
		var v struct {
			A struct {
				Limit    float64 `json:"limit"`
				InFlight float64 `json:"in_flight"`
				Latency  float64 `json:"latency"`
				NoLoad   float64 `json:"no_load_latency"`
			} `json:"concurrency_adaptive"`
		}
		resp, err := client.Get(url)
		if err != nil {
			continue
		}
		err = json.NewDecoder(resp.Body).Decode(&v)
		resp.Body.Close()
		if err == nil {
			out = append(out, sample{at: time.Since(start), limit: v.A.Limit, inFlight: v.A.InFlight, latency: v.A.Latency, noLoad: v.A.NoLoad})
		}
	}
}
