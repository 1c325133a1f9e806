// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package main

import (
	"fmt"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"
)

// upstream is the test upstream: it works on at most workers requests at
// once, each for the service time, and queues the others first come,
// first served (a Go channel's waiting senders are served in order), as
// an application server with a worker pool does. Its capacity is
// workers / service requests per second.
type upstream struct {
	workers chan struct{}
	service atomic.Int64 // nanoseconds; may change during a run
	srv     *http.Server
	addr    string

	mu   sync.Mutex
	work []work // what each request took of a worker, as it happened
}

// work is how long a request held a worker, until end: the service time
// and what the scheduler added to it.
type work struct {
	end  time.Time
	took time.Duration
}

func startUpstream(workers int, service time.Duration) (*upstream, error) {
	u := &upstream{workers: make(chan struct{}, workers)}
	u.service.Store(int64(service))
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	u.addr = l.Addr().String()
	u.srv = &http.Server{Handler: u, ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = u.srv.Serve(l) }()
	return u, nil
}

func (u *upstream) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	select {
	case u.workers <- struct{}{}:
	case <-r.Context().Done():
		return
	}
	began := time.Now()
	time.Sleep(time.Duration(u.service.Load()))
	<-u.workers
	end := time.Now()
	u.mu.Lock()
	u.work = append(u.work, work{end: end, took: end.Sub(began)})
	u.mu.Unlock()
	fmt.Fprintln(w, "ok")
}

func (u *upstream) setService(d time.Duration) { u.service.Store(int64(d)) }

func (u *upstream) stop() { _ = u.srv.Close() }

// done is what the upstream's workers did.
func (u *upstream) done() []work {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.work
}
