// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package main

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/bench/internal/benchkit"
	"github.com/caddy-tokenbucket/ratelimit/internal/redistest"
)

// redisServer is the harness's own redis-server (or the server that
// RATE_LIMIT_REDIS_SERVER names), on a free loopback port, without
// persistence.
type redisServer struct {
	proc    *proc
	addr    string
	version string
}

func startRedis(tmp string) (*redisServer, error) {
	port, err := benchkit.FreePort()
	if err != nil {
		return nil, err
	}
	dir := filepath.Join(tmp, "redis")
	if err := mkdir(dir); err != nil {
		return nil, err
	}
	p, err := start("redis-server", filepath.Join(tmp, "redis.log"), nil, redistest.ServerBin(),
		"--port", strconv.Itoa(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
		"--daemonize", "no", "--dir", dir, "--databases", "1")
	if err != nil {
		return nil, err
	}
	r := &redisServer{proc: p, addr: fmt.Sprintf("127.0.0.1:%d", port)}
	if err := waitListening(p, r.addr, 10*time.Second); err != nil {
		return nil, err
	}
	info, err := r.do("INFO", "server")
	if err != nil {
		return nil, err
	}
	r.version = infoField(info, "redis_version")
	return r, nil
}

// scriptCalls is the number of EVALSHA and EVAL calls Redis has served
// (one per round trip of the rate_limit Redis store) and the time Redis
// spent in them, from their usec= in INFO commandstats: the scripts' run
// time, the commands they call included, without reading the requests or
// writing the replies.
func (r *redisServer) scriptCalls() (calls int64, took time.Duration, err error) {
	info, err := r.do("INFO", "commandstats")
	if err != nil {
		return 0, 0, err
	}
	for _, cmd := range []string{"cmdstat_evalsha", "cmdstat_eval"} {
		v := infoField(info, cmd) // calls=123,usec=4567,usec_per_call=...
		if v == "" {
			continue
		}
		var c, usec int64
		if _, err := fmt.Sscanf(v, "calls=%d,usec=%d,", &c, &usec); err != nil {
			return 0, 0, fmt.Errorf("INFO commandstats: %s: %q", cmd, v)
		}
		calls += c
		took += time.Duration(usec) * time.Microsecond
	}
	return calls, took, nil
}

// redisUse is what the harness's Redis has done so far: its script calls,
// the time it spent in them, and its process's CPU.
type redisUse struct {
	calls       int64
	script, cpu time.Duration
}

func (r *redisServer) use() (redisUse, error) {
	var u redisUse
	var err error
	if u.calls, u.script, err = r.scriptCalls(); err != nil {
		return u, err
	}
	u.cpu, err = procCPU(r.proc.pid())
	return u, err
}

// do sends one command and returns its reply as a string.
func (r *redisServer) do(args ...string) (string, error) {
	c, err := net.DialTimeout("tcp", r.addr, 2*time.Second)
	if err != nil {
		return "", err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	var b strings.Builder
	fmt.Fprintf(&b, "*%d\r\n", len(args))
	for _, a := range args {
		fmt.Fprintf(&b, "$%d\r\n%s\r\n", len(a), a)
	}
	if _, err := io.WriteString(c, b.String()); err != nil {
		return "", err
	}
	br := bufio.NewReader(c)
	line, err := br.ReadString('\n')
	if err != nil {
		return "", err
	}
	line = strings.TrimRight(line, "\r\n")
	switch {
	case line == "":
		return "", fmt.Errorf("redis: empty reply")
	case line[0] == '+' || line[0] == ':':
		return line[1:], nil
	case line[0] == '-':
		return "", fmt.Errorf("redis: %s", line[1:])
	case line[0] == '$':
		n, err := strconv.Atoi(line[1:])
		if err != nil || n < 0 {
			return "", nil
		}
		buf := make([]byte, n+2)
		if _, err := io.ReadFull(br, buf); err != nil {
			return "", err
		}
		return string(buf[:n]), nil
	}
	return "", fmt.Errorf("redis: unexpected reply %q", line)
}

// infoField finds "name:value" in an INFO reply.
func infoField(info, name string) string {
	for _, line := range strings.Split(info, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), name+":"); ok {
			return v
		}
	}
	return ""
}
