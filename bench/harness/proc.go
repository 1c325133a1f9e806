// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package main

import (
	"bytes"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// procs tracks every process the harness starts, so that all of them are
// stopped on the way out, also after a failure or a signal, and so that
// their CPU time can be told apart from the rest of the machine's.
var procs = &registry{live: map[int]*proc{}}

type registry struct {
	mu      sync.Mutex
	live    map[int]*proc
	doneCPU time.Duration // CPU of the processes already reaped
}

type proc struct {
	name string
	cmd  *exec.Cmd
	log  string // file with its stdout and stderr
	done chan struct{}
	err  error // from Wait, once done is closed
}

// start runs a program in its own process group, with stdout and stderr
// going to logFile. The kernel kills it if the harness dies first.
func start(name, logFile string, env []string, bin string, args ...string) (*proc, error) {
	f, err := os.Create(logFile)
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = f, f
	cmd.Env = append(os.Environ(), env...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	procs.mu.Lock()
	defer procs.mu.Unlock()
	if err := cmd.Start(); err != nil {
		f.Close()
		return nil, fmt.Errorf("starting %s: %w", name, err)
	}
	p := &proc{name: name, cmd: cmd, log: logFile, done: make(chan struct{})}
	procs.live[cmd.Process.Pid] = p
	go func() {
		p.err = cmd.Wait()
		f.Close()
		procs.mu.Lock()
		if st := cmd.ProcessState; st != nil {
			procs.doneCPU += st.UserTime() + st.SystemTime()
		}
		delete(procs.live, cmd.Process.Pid)
		procs.mu.Unlock()
		close(p.done)
	}()
	return p, nil
}

func (p *proc) pid() int { return p.cmd.Process.Pid }

// exited reports whether the process has ended, with its log's tail.
func (p *proc) exited() error {
	select {
	case <-p.done:
		return fmt.Errorf("%s exited (%v); last log lines:\n%s", p.name, p.err, tail(p.log, 15))
	default:
		return nil
	}
}

// stop ends the process: SIGTERM, then SIGKILL if it is still there after
// the grace period.
func (p *proc) stop(grace time.Duration) {
	select {
	case <-p.done:
		return
	default:
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(grace):
		_ = p.cmd.Process.Kill()
		<-p.done
	}
}

// stopAll stops every process still running, in parallel.
func stopAll() {
	procs.mu.Lock()
	var all []*proc
	for _, p := range procs.live {
		all = append(all, p)
	}
	procs.mu.Unlock()
	var wg sync.WaitGroup
	for _, p := range all {
		wg.Add(1)
		go func() { defer wg.Done(); p.stop(3 * time.Second) }()
	}
	wg.Wait()
}

// childCPU is the CPU time of every process the harness started: the
// reaped ones and the live ones so far.
func childCPU() time.Duration {
	procs.mu.Lock()
	defer procs.mu.Unlock()
	total := procs.doneCPU
	for pid := range procs.live {
		if c, err := procCPU(pid); err == nil {
			total += c
		}
	}
	return total
}

// tail returns the last n lines of a file.
func tail(file string, n int) string {
	b, err := os.ReadFile(file)
	if err != nil {
		return err.Error()
	}
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// waitListening waits until addr accepts connections or p exits.
func waitListening(p *proc, addr string, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		if err := p.exited(); err != nil {
			return err
		}
		c, err := net.DialTimeout("tcp", addr, 200*time.Millisecond)
		if err == nil {
			c.Close()
			return nil
		}
		time.Sleep(50 * time.Millisecond)
	}
	return fmt.Errorf("%s: nothing listening on %s after %v; last log lines:\n%s", p.name, addr, timeout, tail(p.log, 15))
}

var clkTck = 100.0 // USER_HZ; 100 on every Linux architecture Go supports

// procCPU is the user+system CPU time of a live process, from
// /proc/<pid>/stat (10 ms resolution).
func procCPU(pid int) (time.Duration, error) {
	b, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "stat"))
	if err != nil {
		return 0, err
	}
	// The command name (field 2) may hold spaces: skip past its ')'.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, errors.New("malformed stat")
	}
	f := strings.Fields(string(b[i+1:]))
	// f[0] is field 3 (state); utime and stime are fields 14 and 15.
	if len(f) < 13 {
		return 0, errors.New("malformed stat")
	}
	ut, err1 := strconv.ParseFloat(f[11], 64)
	st, err2 := strconv.ParseFloat(f[12], 64)
	if err1 != nil || err2 != nil {
		return 0, errors.New("malformed stat")
	}
	return time.Duration((ut + st) / clkTck * float64(time.Second)), nil
}

// procStatusKB reads a "Vm..." field (in kB) of /proc/<pid>/status.
func procStatusKB(pid int, field string) (int64, error) {
	b, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "status"))
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, field+":"); ok {
			v = strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB"))
			return strconv.ParseInt(v, 10, 64)
		}
	}
	return 0, fmt.Errorf("no %s in /proc/%d/status", field, pid)
}

// machineCPU is the busy and total CPU time of the whole machine so far,
// from the first line of /proc/stat.
func machineCPU() (busy, total time.Duration) {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0, 0
	}
	line, _, _ := strings.Cut(string(b), "\n")
	f := strings.Fields(line)
	if len(f) < 8 || f[0] != "cpu" {
		return 0, 0
	}
	var sum, idle float64
	for i, s := range f[1:] {
		if i >= 8 { // guest time is already in user
			break
		}
		v, _ := strconv.ParseFloat(s, 64)
		sum += v
		if i == 3 || i == 4 { // idle, iowait
			idle += v
		}
	}
	tick := float64(time.Second) / clkTck
	return time.Duration((sum - idle) * tick), time.Duration(sum * tick)
}

// selfCPU is the harness's own CPU time.
func selfCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
