// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

// Package redistest starts throwaway redis-server processes on free
// ports for tests, so that a test can kill, pause and restart them. It is
// imported by tests and benchmarks only.
package redistest

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// The variables that name the server and its command-line client, so
// that the tests run on any Redis-compatible server:
//
//	RATE_LIMIT_REDIS_SERVER=valkey-server go test ./...
//
// The server is redis-server by default. The client is, by default, the
// server's own: its name with -cli for -server, in the server's folder
// when it is named by a path (valkey-server: valkey-cli); else redis-cli.
const (
	ServerEnv = "RATE_LIMIT_REDIS_SERVER"
	CLIEnv    = "RATE_LIMIT_REDIS_CLI"
)

// ServerBin is the server binary the tests start.
func ServerBin() string {
	if bin := os.Getenv(ServerEnv); bin != "" {
		return bin
	}
	return "redis-server"
}

// CLIBin is the command-line client the tests run.
func CLIBin() string {
	if bin := os.Getenv(CLIEnv); bin != "" {
		return bin
	}
	dir, name := filepath.Split(ServerBin())
	if base, ok := strings.CutSuffix(name, "-server"); ok {
		return dir + base + "-cli"
	}
	return "redis-cli"
}

// Require skips the test, loudly, when the server or its client is
// missing, and fails it in CI, where the Redis tests must run.
func Require(t testing.TB) {
	t.Helper()
	for _, bin := range []string{ServerBin(), CLIBin()} {
		if _, err := exec.LookPath(bin); err != nil {
			if os.Getenv("CI") == "true" {
				t.Fatalf("%s not found: CI must run the Redis tests (apt-get install redis-server, or name the server in %s)", bin, ServerEnv)
			}
			t.Skipf("REDIS TESTS SKIPPED: %s not found (apt-get install redis-server, or name the server in %s and its client in %s)", bin, ServerEnv, CLIEnv)
		}
	}
}

// A Server is a redis-server process of a test.
type Server struct {
	T    testing.TB
	Port int
	Dir  string
	Args []string
	Cmd  *exec.Cmd
}

// Start starts a redis-server that keeps nothing on disk, with extra
// arguments, and kills it when the test ends.
func Start(t testing.TB, extra ...string) *Server {
	t.Helper()
	Require(t)
	r := &Server{T: t, Port: FreePort(t, 0), Dir: t.TempDir()}
	r.Args = append([]string{"--bind", "127.0.0.1", "--port", strconv.Itoa(r.Port),
		"--save", "", "--appendonly", "no", "--dir", r.Dir}, extra...)
	r.Start()
	t.Cleanup(r.Kill)
	return r
}

// Start starts the server (again) with its arguments.
func (r *Server) Start() {
	r.T.Helper()
	r.Cmd = exec.Command(ServerBin(), r.Args...)
	r.Cmd.Dir = r.Dir
	if err := r.Cmd.Start(); err != nil {
		r.T.Fatalf("starting %s: %v", ServerBin(), err)
	}
	r.WaitReady()
}

// WaitReady waits until the server answers PING.
func (r *Server) WaitReady() {
	r.T.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		if out, err := r.TryCLI("PING"); err == nil && out == "PONG" {
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
	r.T.Fatalf("%s on port %d did not start", ServerBin(), r.Port)
}

// Addr is the server's address.
func (r *Server) Addr() string { return "127.0.0.1:" + strconv.Itoa(r.Port) }

// Kill stops the server at once, as a crash would.
func (r *Server) Kill() {
	if r.Cmd != nil && r.Cmd.Process != nil {
		_ = r.Cmd.Process.Signal(syscall.SIGCONT)
		_ = r.Cmd.Process.Kill()
		_ = r.Cmd.Wait()
		r.Cmd = nil
	}
}

// Restart starts the server again on the same port, empty.
func (r *Server) Restart() { r.Kill(); r.Start() }

// Pause freezes the server: connections stay open, nothing answers.
func (r *Server) Pause() { _ = r.Cmd.Process.Signal(syscall.SIGSTOP) }

// Resume unfreezes a paused server.
func (r *Server) Resume() { _ = r.Cmd.Process.Signal(syscall.SIGCONT) }

// TryCLI runs the command-line client against the server.
func (r *Server) TryCLI(args ...string) (string, error) {
	out, err := exec.Command(CLIBin(), append([]string{"-p", strconv.Itoa(r.Port)}, args...)...).CombinedOutput()
	return strings.TrimSpace(string(out)), err
}

// CLI runs the command-line client against the server, and fails the
// test if it fails.
func (r *Server) CLI(args ...string) string {
	r.T.Helper()
	out, err := r.TryCLI(args...)
	if err != nil {
		r.T.Fatalf("%s %v: %v: %s", CLIBin(), args, err, out)
	}
	return out
}

// Calls is how many times the server has run a script.
func (r *Server) Calls() int {
	r.T.Helper()
	n := 0
	for _, line := range strings.Split(r.CLI("INFO", "commandstats"), "\n") {
		for _, cmd := range []string{"cmdstat_evalsha:calls=", "cmdstat_eval:calls="} {
			if rest, ok := strings.CutPrefix(strings.TrimSpace(line), cmd); ok {
				v, _, _ := strings.Cut(rest, ",")
				c, _ := strconv.Atoi(v)
				n += c
			}
		}
	}
	return n
}

// ScriptStats is what INFO commandstats says of the script calls: how
// many the server ran, and the microseconds it spent in them.
func (r *Server) ScriptStats() (calls, usec int64) {
	r.T.Helper()
	for _, line := range strings.Split(r.CLI("INFO", "commandstats"), "\n") {
		for _, cmd := range []string{"cmdstat_evalsha:", "cmdstat_eval:"} {
			rest, ok := strings.CutPrefix(strings.TrimSpace(line), cmd)
			if !ok {
				continue
			}
			for _, kv := range strings.Split(rest, ",") {
				k, v, _ := strings.Cut(kv, "=")
				n, _ := strconv.ParseInt(v, 10, 64)
				switch k {
				case "calls":
					calls += n
				case "usec":
					usec += n
				}
			}
		}
	}
	return calls, usec
}

// FreePort finds a free TCP port; with bus > 0 also port+bus is free
// (Redis Cluster's bus port). The port is below the kernel's ephemeral
// range, so that no outgoing connection of a busy machine takes it
// between this check and the server's bind.
func FreePort(t testing.TB, bus int) int {
	t.Helper()
	hi := ephemeralLow() - bus
	for range 1000 {
		port := 10000 + rand.IntN(hi-10000)
		if free(port) && (bus == 0 || free(port+bus)) {
			return port
		}
	}
	t.Fatal("no free port")
	return 0
}

// free reports whether a TCP port of 127.0.0.1 can be bound.
func free(port int) bool {
	l, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(port))
	if err != nil {
		return false
	}
	l.Close()
	return true
}

// ephemeralLow is the first port the kernel gives outgoing connections.
func ephemeralLow() int {
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err == nil {
		if f := strings.Fields(string(b)); len(f) == 2 {
			if n, err := strconv.Atoi(f[0]); err == nil && n > 30000 {
				return n
			}
		}
	}
	return 32768
}

// StartCluster starts a Redis Cluster of three masters.
func StartCluster(t testing.TB) []*Server {
	t.Helper()
	return StartClusterWith(t, 0, "--cluster-node-timeout", "2000")
}

// StartReplicatedCluster starts a Redis Cluster of three masters, each
// with a replica, that fails over as soon as Redis can: a node that does
// not answer for a second is failed, and its replica takes over however
// long ago it last heard from its master. replicas[i] is masters[i]'s,
// linked to it when this returns.
func StartReplicatedCluster(t testing.TB) (masters, replicas []*Server) {
	t.Helper()
	nodes := StartClusterWith(t, 1, "--cluster-node-timeout", "1000", "--cluster-replica-validity-factor", "0")
	byPort := make(map[string]*Server, len(nodes))
	for _, n := range nodes {
		byPort[strconv.Itoa(n.Port)] = n
	}
	deadline := time.Now().Add(20 * time.Second)
	for _, n := range nodes {
		for {
			// A replica's ROLE: slave, its master's host and port, the
			// link's state, the offset.
			role := strings.Fields(n.CLI("ROLE"))
			if role[0] == "master" {
				masters = append(masters, n)
				break
			}
			if len(role) >= 4 && role[3] == "connected" {
				replicas = append(replicas, n)
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("replica on port %d did not link to its master: %v", n.Port, role)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	ordered := make([]*Server, len(masters))
	for _, r := range replicas {
		m := byPort[strings.Fields(r.CLI("ROLE"))[2]]
		for i := range masters {
			if masters[i] == m {
				ordered[i] = r
			}
		}
	}
	if len(masters) != 3 || slices.Contains(ordered, nil) {
		t.Fatalf("cluster of %d masters and %d replicas, not three of each linked", len(masters), len(replicas))
	}
	return masters, ordered
}

// ClusterOK reports whether the node sees its cluster serve every slot.
func (r *Server) ClusterOK() bool {
	out, err := r.TryCLI("CLUSTER", "INFO")
	return err == nil && strings.Contains(out, "cluster_state:ok")
}

// StartClusterWith starts a Redis Cluster of three masters with the
// given replicas each, its nodes started with the extra arguments. Each
// keeps its cluster config in its Dir, so that a node restarted takes
// its place again.
func StartClusterWith(t testing.TB, replicas int, extra ...string) []*Server {
	t.Helper()
	Require(t)
	var nodes []*Server
	var addrs []string
	for range 3 * (1 + replicas) {
		r := &Server{T: t, Port: FreePort(t, 10000), Dir: t.TempDir()}
		r.Args = append([]string{"--bind", "127.0.0.1", "--port", strconv.Itoa(r.Port), "--save", "", "--appendonly", "no",
			"--dir", r.Dir, "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"}, extra...)
		r.Start()
		t.Cleanup(r.Kill)
		nodes = append(nodes, r)
		addrs = append(addrs, r.Addr())
	}
	args := append([]string{"--cluster", "create"}, addrs...)
	args = append(args, "--cluster-replicas", strconv.Itoa(replicas), "--cluster-yes")
	// The client waits for the nodes to agree on the config for as long
	// as it takes: a minute, then the test fails with what each node
	// knows, instead of hanging until the test binary's timeout.
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if out, err := exec.CommandContext(ctx, CLIBin(), args...).CombinedOutput(); err != nil {
		var nodesOf strings.Builder
		for _, n := range nodes {
			out, _ := n.TryCLI("CLUSTER", "NODES")
			fmt.Fprintf(&nodesOf, "\nCLUSTER NODES of %s:\n%s", n.Addr(), out)
		}
		t.Fatalf("%s --cluster create: %v: %s%s", CLIBin(), err, out, nodesOf.String())
	}
	deadline := time.Now().Add(20 * time.Second)
	for _, n := range nodes {
		for !n.ClusterOK() {
			if time.Now().After(deadline) {
				t.Fatal("cluster did not come up")
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	return nodes
}
