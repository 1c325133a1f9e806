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
)

// redisServer is the harness's own redis-server, on a free loopback port,
// without persistence.
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
	p, err := start("redis-server", filepath.Join(tmp, "redis.log"), nil, "redis-server",
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

// scriptCalls is the number of EVALSHA and EVAL calls Redis has served:
// one per round trip of the rate_limit Redis store.
func (r *redisServer) scriptCalls() (int64, error) {
	info, err := r.do("INFO", "commandstats")
	if err != nil {
		return 0, err
	}
	var n int64
	for _, cmd := range []string{"cmdstat_evalsha", "cmdstat_eval"} {
		v := infoField(info, cmd) // calls=123,usec=...
		if v == "" {
			continue
		}
		calls, _, _ := strings.Cut(strings.TrimPrefix(v, "calls="), ",")
		c, err := strconv.ParseInt(calls, 10, 64)
		if err != nil {
			return 0, fmt.Errorf("INFO commandstats: %s: %q", cmd, v)
		}
		n += c
	}
	return n, nil
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
