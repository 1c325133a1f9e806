// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package main

import (
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/bench/internal/benchkit"
)

// caddyInst is one running Caddy.
type caddyInst struct {
	name  string
	proc  *proc
	url   string // http://127.0.0.1:port/
	admin string // admin address, "" when off
}

// caddySpec describes an instance: which binary, and what goes inside
// its one site block.
type caddySpec struct {
	name  string
	bin   string
	site  string // directives, one per line
	admin bool   // admin API on a free port (for /debug/pprof and /debug/vars)
}

// caddyfile writes the instance's config. Every instance listens on its
// own loopback port, without HTTPS, and with its admin API off or on a
// port of its own.
func caddyfile(port, adminPort int, site string) string {
	var b strings.Builder
	b.WriteString("{\n")
	if adminPort == 0 {
		b.WriteString("\tadmin off\n")
	} else {
		fmt.Fprintf(&b, "\tadmin 127.0.0.1:%d\n", adminPort)
	}
	b.WriteString("\tauto_https off\n\tpersist_config off\n}\n\n")
	fmt.Fprintf(&b, "http://127.0.0.1:%d {\n\tbind 127.0.0.1\n", port)
	for _, line := range strings.Split(strings.TrimSpace(site), "\n") {
		b.WriteString("\t" + line + "\n")
	}
	b.WriteString("}\n")
	return b.String()
}

func (e *env) startCaddy(spec caddySpec) (*caddyInst, error) {
	port, err := benchkit.FreePort()
	if err != nil {
		return nil, err
	}
	adminPort := 0
	if spec.admin {
		if adminPort, err = benchkit.FreePort(); err != nil {
			return nil, err
		}
	}
	dir := filepath.Join(e.tmp, "caddy-"+spec.name)
	if err := mkdir(dir); err != nil {
		return nil, err
	}
	cfg := filepath.Join(dir, "Caddyfile")
	if err := os.WriteFile(cfg, []byte(caddyfile(port, adminPort, spec.site)), 0o644); err != nil {
		return nil, err
	}
	env := []string{
		"XDG_CONFIG_HOME=" + filepath.Join(dir, "config"),
		"XDG_DATA_HOME=" + filepath.Join(dir, "data"),
	}
	p, err := start("caddy "+spec.name, filepath.Join(dir, "caddy.log"), env, spec.bin,
		"run", "--config", cfg, "--adapter", "caddyfile")
	if err != nil {
		return nil, err
	}
	c := &caddyInst{name: spec.name, proc: p, url: fmt.Sprintf("http://127.0.0.1:%d/", port)}
	if adminPort != 0 {
		c.admin = fmt.Sprintf("127.0.0.1:%d", adminPort)
	}
	if err := waitListening(p, fmt.Sprintf("127.0.0.1:%d", port), 20*time.Second); err != nil {
		p.stop(time.Second)
		return nil, fmt.Errorf("caddy %s (config %s): %w", spec.name, cfg, err)
	}
	return c, nil
}

func (c *caddyInst) stop() { c.proc.stop(5 * time.Second) }

// get sends one request and returns its status.
func get(url string, hdr map[string]string) (int, error) {
	req, err := http.NewRequest("GET", url, nil)
	if err != nil {
		return 0, err
	}
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	client := http.Client{Timeout: 5 * time.Second}
	resp, err := client.Do(req)
	if err != nil {
		return 0, err
	}
	resp.Body.Close()
	return resp.StatusCode, nil
}

// expect checks that a fresh request gets the given status.
func expect(c *caddyInst, hdr map[string]string, want ...int) error {
	code, err := get(c.url, hdr)
	if err != nil {
		return fmt.Errorf("%s: %w", c.name, err)
	}
	for _, w := range want {
		if code == w {
			return nil
		}
	}
	return fmt.Errorf("%s: status %d, expected %v; last log lines:\n%s", c.name, code, want, tail(c.proc.log, 10))
}
