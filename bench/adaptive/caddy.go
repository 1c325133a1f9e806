// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package main

import (
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/bench/internal/benchkit"
)

// limiters are the configurations a scenario runs, by name: what goes in
// the site before reverse_proxy.
var limiters = map[string]string{
	"no limiter": "",
	"adaptive": `rate_limit {
		zone backend {
			key static
			concurrency adaptive
		}
	}`,
	"concurrency 8": `rate_limit {
		zone backend {
			key static
			concurrency 8
		}
	}`,
	"adaptive, reserve critical 25%": `rate_limit {
		zone backend {
			key static
			concurrency adaptive {
				priority {header.X-Priority}
				reserve critical 25%
			}
		}
	}`,
}

// caddyProc is a running Caddy.
type caddyProc struct {
	cmd   *exec.Cmd
	url   string // the site
	admin string // the admin endpoint's address
	done  chan struct{}
}

// startCaddy runs bin with a site that proxies to the upstream behind
// the named limiter, its state and log in dir.
func startCaddy(bin, dir, limiter, upstream string) (*caddyProc, error) {
	port, err := benchkit.FreePort()
	if err != nil {
		return nil, err
	}
	admin, err := benchkit.FreePort()
	if err != nil {
		return nil, err
	}
	cfg := fmt.Sprintf(`{
	admin 127.0.0.1:%d
	auto_https off
	persist_config off
}

http://127.0.0.1:%d {
	bind 127.0.0.1
	%s
	reverse_proxy %s
}
`, admin, port, limiters[limiter], upstream)
	file := filepath.Join(dir, "Caddyfile")
	if err := os.WriteFile(file, []byte(cfg), 0o644); err != nil {
		return nil, err
	}
	logf, err := os.Create(filepath.Join(dir, "caddy.log"))
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(bin, "run", "--config", file, "--adapter", "caddyfile")
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.Env = append(os.Environ(), "XDG_CONFIG_HOME="+filepath.Join(dir, "config"), "XDG_DATA_HOME="+filepath.Join(dir, "data"))
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		logf.Close()
		return nil, err
	}
	c := &caddyProc{cmd: cmd, url: fmt.Sprintf("http://127.0.0.1:%d/", port), admin: fmt.Sprintf("127.0.0.1:%d", admin), done: make(chan struct{})}
	go func() { _ = cmd.Wait(); logf.Close(); close(c.done) }()
	if err := c.wait(fmt.Sprintf("127.0.0.1:%d", port)); err != nil {
		c.stop()
		return nil, fmt.Errorf("%w (config and log in %s)", err, dir)
	}
	return c, nil
}

// wait waits until addr accepts connections.
func (c *caddyProc) wait(addr string) error {
	for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		select {
		case <-c.done:
			return fmt.Errorf("caddy exited")
		default:
		}
		if conn, err := net.DialTimeout("tcp", addr, 200*time.Millisecond); err == nil {
			conn.Close()
			return nil
		}
	}
	return fmt.Errorf("caddy not listening on %s", addr)
}

// stop ends Caddy: SIGTERM, then SIGKILL after 5s.
func (c *caddyProc) stop() {
	_ = c.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-c.done:
	case <-time.After(5 * time.Second):
		_ = c.cmd.Process.Kill()
		<-c.done
	}
}
