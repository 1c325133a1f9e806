// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package main

import (
	"context"
	"net/http"
	"sync"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/redis/go-redis/v9"
)

// Wait is the throughput phase's floor for a limiter that asks a server:
// each request waits, as a request waits for its Redis call, but for
// another goroutine of the process, which answers the requests queued
// meanwhile together after waitFor, as a pipelined round trip would, with
// no network, no encoding and no decision. What it costs Caddy's process
// per request is what waiting costs: the handler's goroutine parked and
// woken, and net/http's read of the connection while it waits.
//
// With `bench_wait redis <address>`, each request makes a real round trip
// to that Redis instead: a PING, batched as the Redis store batches its
// calls (internal/rediswire/pipeline.go: a request that finds nothing in
// flight goes at once, alone; the others queue and go together as the
// next pipeline, or as another flight of at least 8, up to 4 flights).
// That is the floor of any limiter that asks Redis through go-redis:
// waiting, and the socket's writes and reads, with no script, no
// arguments and no decision.
type Wait struct {
	Redis string `json:"redis,omitempty"`

	queue  chan chan struct{}
	done   chan struct{}
	client *redis.Client

	mu      sync.Mutex
	flights int
	waiting []chan struct{}
}

// waitFor stands in for a round trip to a Redis on the same host.
const waitFor = 20 * time.Microsecond

func init() {
	caddy.RegisterModule(new(Wait))
	httpcaddyfile.RegisterHandlerDirective("bench_wait", func(h httpcaddyfile.Helper) (caddyhttp.MiddlewareHandler, error) {
		h.Next()
		w := new(Wait)
		if h.NextArg() {
			if h.Val() != "redis" || !h.NextArg() {
				return nil, h.ArgErr()
			}
			w.Redis = h.Val()
		}
		if h.NextArg() {
			return nil, h.ArgErr()
		}
		return w, nil
	})
	httpcaddyfile.RegisterDirectiveOrder("bench_wait", httpcaddyfile.Before, "respond")
}

// CaddyModule returns the Caddy module information.
func (*Wait) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{ID: "http.handlers.bench_wait", New: func() caddy.Module { return new(Wait) }}
}

// Provision starts the goroutines that answer.
func (w *Wait) Provision(caddy.Context) error {
	w.queue, w.done = make(chan chan struct{}, 1024), make(chan struct{})
	if w.Redis != "" {
		w.client = redis.NewClient(&redis.Options{Addr: w.Redis})
		return nil
	}
	go w.answer()
	return nil
}

// ping waits for a PING of Redis, batched with those of other requests.
func (w *Wait) ping() {
	w.mu.Lock()
	if w.flights == 0 {
		w.flights++
		w.mu.Unlock()
		w.client.Ping(context.Background())
		w.landed()
		return
	}
	c := make(chan struct{}, 1)
	w.waiting = append(w.waiting, c)
	if w.flights < 4 && len(w.waiting) >= 8 {
		batch := w.waiting
		w.waiting = nil
		w.flights++
		w.mu.Unlock()
		go w.send(batch)
	} else {
		w.mu.Unlock()
	}
	<-c
}

// landed ends a flight: the requests queued meanwhile go as the next.
func (w *Wait) landed() {
	if batch := w.next(); batch != nil {
		go w.send(batch)
	}
}

// send sends a PING per request of batch in one pipeline, and answers
// them, as long as requests are queued.
func (w *Wait) send(batch []chan struct{}) {
	for ; batch != nil; batch = w.next() {
		pipe := w.client.Pipeline()
		for range batch {
			pipe.Ping(context.Background())
		}
		_, _ = pipe.Exec(context.Background())
		for _, c := range batch {
			c <- struct{}{}
		}
	}
}

// next takes the requests queued as a flight's next batch, or ends the
// flight when none are (as internal/rediswire's pipeline does).
func (w *Wait) next() []chan struct{} {
	w.mu.Lock()
	defer w.mu.Unlock()
	batch := w.waiting
	w.waiting = nil
	if len(batch) == 0 {
		w.flights--
		return nil
	}
	return batch
}

// Cleanup stops them.
func (w *Wait) Cleanup() error {
	close(w.done)
	if w.client != nil {
		return w.client.Close()
	}
	return nil
}

func (w *Wait) answer() {
	var batch []chan struct{}
	for {
		select {
		case <-w.done:
			return
		case c := <-w.queue:
			batch = append(batch[:0], c)
		}
		for more := true; more; {
			select {
			case c := <-w.queue:
				batch = append(batch, c)
			default:
				more = false
			}
		}
		time.Sleep(waitFor)
		for _, c := range batch {
			c <- struct{}{}
		}
	}
}

// ServeHTTP waits for the answer, then goes on.
func (w *Wait) ServeHTTP(rw http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	if w.client != nil {
		w.ping()
		return next.ServeHTTP(rw, r)
	}
	c := make(chan struct{}, 1)
	w.queue <- c
	<-c
	return next.ServeHTTP(rw, r)
}

var (
	_ caddy.Provisioner           = (*Wait)(nil)
	_ caddy.CleanerUpper          = (*Wait)(nil)
	_ caddyhttp.MiddlewareHandler = (*Wait)(nil)
)
