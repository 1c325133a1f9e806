// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package main

import (
	"net/http"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// Wait is the throughput phase's floor for a limiter that asks a server:
// each request waits, as a request waits for its Redis call, but for
// another goroutine of the process, which answers the requests queued
// meanwhile together after waitFor, as a pipelined round trip would, with
// no network, no encoding and no decision. What it costs Caddy's process
// per request is what waiting costs: the handler's goroutine parked and
// woken, and net/http's read of the connection while it waits.
type Wait struct {
	queue chan chan struct{}
	done  chan struct{}
}

// waitFor stands in for a round trip to a Redis on the same host.
const waitFor = 20 * time.Microsecond

func init() {
	caddy.RegisterModule(Wait{})
	httpcaddyfile.RegisterHandlerDirective("bench_wait", func(h httpcaddyfile.Helper) (caddyhttp.MiddlewareHandler, error) {
		h.Next()
		if h.NextArg() {
			return nil, h.ArgErr()
		}
		return new(Wait), nil
	})
	httpcaddyfile.RegisterDirectiveOrder("bench_wait", httpcaddyfile.Before, "respond")
}

// CaddyModule returns the Caddy module information.
func (Wait) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{ID: "http.handlers.bench_wait", New: func() caddy.Module { return new(Wait) }}
}

// Provision starts the goroutine that answers.
func (w *Wait) Provision(caddy.Context) error {
	w.queue, w.done = make(chan chan struct{}, 1024), make(chan struct{})
	go w.answer()
	return nil
}

// Cleanup stops it.
func (w *Wait) Cleanup() error {
	close(w.done)
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
