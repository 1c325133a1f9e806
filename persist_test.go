// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/gcra"
	"github.com/caddy-tokenbucket/ratelimit/internal/memstore"
	"github.com/caddy-tokenbucket/ratelimit/internal/siphash"
	"github.com/caddy-tokenbucket/ratelimit/internal/store"
	"github.com/caddyserver/certmagic"
	"go.uber.org/zap"
)

// A reload that turns persistence off stops it for the tables it keeps:
// the module's pool gives the new config the table, which it rebinds, and
// which writes nothing when it is destroyed as Caddy exits.
func TestPersistOffOnReload(t *testing.T) {
	dir := t.TempDir()
	sn := &memstore.Snapshots{Storage: &certmagic.FileStorage{Path: dir}, Dir: "rate_limit/test", Key: siphash.NewKey(), Interval: time.Second, Logger: zap.NewNop(),
		Exiting: func() bool { return true }}
	l := gcra.NewLimit(1.0/60, 2)
	specs := []store.ZoneSpec{{Name: "off_on_reload", Bucket: true, Shape: l}}
	before := &LocalStore{MaxKeys: 1000, snaps: sn}
	if _, err := before.engine(specs); err != nil {
		t.Fatal(err)
	}
	id := before.acquired[0]
	tab := pooledBuckets(t, id)
	<-tab.Loaded()
	off := false
	after := &LocalStore{MaxKeys: 1000, Persist: &off}
	s2, err := after.engine(specs)
	if err != nil {
		t.Fatal(err)
	}
	if n, _ := localTables.References(id); n != 2 || after.acquired[0] != id {
		t.Fatalf("the reload did not keep the table: %d references", n)
	}
	d := &store.Demands{Buckets: []store.BucketDemand{{Key: key("k"), Limit: l, Cost: l.CostTime(1)}}}
	if ok, err := s2.Take(context.Background(), time.Now(), d); !ok || err != nil {
		t.Fatalf("a request of a full bucket: %v, %v", ok, err)
	}
	if memstore.BucketAt(tab, key("k")) == 0 {
		t.Fatal("the reloaded store spent in another table")
	}
	for _, st := range []*LocalStore{before, after} { // the last destroys the table, as Caddy exits
		if err := st.Cleanup(); err != nil {
			t.Error(err)
		}
	}
	var files []string
	_ = filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err == nil && !d.IsDir() {
			files = append(files, path)
		}
		return err
	})
	if len(files) != 0 {
		t.Errorf("persist off wrote %v", files)
	}
}

// pooledBuckets is the bucket table the local stores share under id.
func pooledBuckets(t *testing.T, id any) *memstore.Table[memstore.Bucket] {
	t.Helper()
	var tab *memstore.Table[memstore.Bucket]
	localTables.Range(func(k, v any) bool {
		if k == id {
			tab, _ = v.(*memstore.Table[memstore.Bucket])
		}
		return tab == nil
	})
	if tab == nil {
		t.Fatalf("no bucket table %v in the pool", id)
	}
	return tab
}

// TestRestartKeepsLimits runs Caddy itself, built from ./cmd/caddy, on the
// default file-system storage: a client that emptied its bucket is still
// limited after a graceful stop (caddy stop, then SIGTERM) and a restart,
// and after a SIGKILL once the persist interval has passed.
func TestRestartKeepsLimits(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs Caddy")
	}
	bin, dir := buildCaddy(t)
	admin, port := freePort(t, 0), freePort(t, 0)
	config := writeFile(t, dir, "Caddyfile", binaryGlobal(admin, port, dir)+fmt.Sprintf(`
http://127.0.0.1:%d {
	handle /ban {
		rate_limit {
			zone fastban {
				key {http.request.header.X-Key}
				rate 1r/s
				burst 1
				ban 5m
			}
			store local {
				persist_interval 200ms
			}
		}
		respond "ok"
	}
	handle {
		rate_limit {remote_host} 1r/h 3 {
			store local {
				persist_interval 200ms
			}
		}
		respond "ok"
	}
}
`, port))
	url := fmt.Sprintf("http://127.0.0.1:%d/", port)
	env := append(os.Environ(), "HOME="+dir, "XDG_DATA_HOME="+filepath.Join(dir, "data"), "XDG_CONFIG_HOME="+filepath.Join(dir, "config"))

	// start runs Caddy and returns once it answers, with its buckets
	// loaded when the storage held some (loading does not hold up the
	// start, so a request could come first).
	start := func(wantLoaded bool) *exec.Cmd {
		t.Helper()
		cmd := exec.Command(bin, "run", "--config", config, "--adapter", "caddyfile")
		cmd.Env = env
		stderr, err := cmd.StderrPipe()
		if err != nil {
			t.Fatal(err)
		}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
		ready, loaded := make(chan struct{}), make(chan struct{})
		go func() {
			sc := bufio.NewScanner(stderr)
			var once, loadOnce sync.Once
			loads := 0
			for sc.Scan() {
				line := sc.Text()
				if strings.Contains(line, "serving initial configuration") {
					once.Do(func() { close(ready) })
				}
				if strings.Contains(line, "buckets loaded") {
					// Both zones' tables.
					if loads++; loads == 2 {
						loadOnce.Do(func() { close(loaded) })
					}
				}
				if testing.Verbose() {
					t.Log(line)
				}
			}
			_, _ = io.Copy(io.Discard, stderr)
		}()
		waitFor := []chan struct{}{ready}
		if wantLoaded {
			waitFor = append(waitFor, loaded)
		}
		for _, ch := range waitFor {
			select {
			case <-ch:
			case <-time.After(time.Minute):
				t.Fatal("Caddy did not start, or did not load the buckets, within a minute")
			}
		}
		return cmd
	}
	status := func() int {
		t.Helper()
		resp, err := http.Get(url)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	// banned is the status and Retry-After of a request of the banned
	// client, which must still be banned.
	banned := func(when string) {
		t.Helper()
		// Longer than the bucket's whole refill: only the ban refuses.
		time.Sleep(1100 * time.Millisecond)
		req, _ := http.NewRequest(http.MethodGet, url+"ban", nil)
		req.Header.Set("X-Key", "k")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if retry, _ := strconv.Atoi(resp.Header.Get("Retry-After")); resp.StatusCode != 429 || retry < 240 {
			t.Fatalf("%s: the banned client got %d, Retry-After %q; want 429 for the rest of its 5m ban", when, resp.StatusCode, resp.Header.Get("Retry-After"))
		}
	}
	wait := func(cmd *exec.Cmd) {
		t.Helper()
		done := make(chan error, 1)
		go func() { done <- cmd.Wait() }()
		select {
		case <-done:
		case <-time.After(time.Minute):
			t.Fatal("Caddy did not exit within a minute")
		}
	}

	cmd := start(false)
	for i := range 3 {
		if got := status(); got != 200 {
			t.Fatalf("request %d: %d, want 200", i+1, got)
		}
	}
	if got := status(); got != 429 {
		t.Fatalf("4th request: %d, want 429", got)
	}
	// A client of the ban zone: 200, then a 429 that bans it for 5m. By
	// the restart its bucket has refilled; its ban has not.
	for i, want := range []int{200, 429} {
		req, _ := http.NewRequest(http.MethodGet, url+"ban", nil)
		req.Header.Set("X-Key", "k")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != want {
			t.Fatalf("ban zone, request %d: %d, want %d", i+1, resp.StatusCode, want)
		}
	}
	time.Sleep(1500 * time.Millisecond)

	// caddy stop: the admin API's /stop.
	if out, err := exec.Command(bin, "stop", "--address", fmt.Sprintf("localhost:%d", admin)).CombinedOutput(); err != nil {
		t.Fatalf("caddy stop: %v\n%s", err, out)
	}
	wait(cmd)
	cmd = start(true)
	if got := status(); got != 429 {
		t.Fatalf("after caddy stop and a restart: %d, want 429", got)
	}
	banned("after caddy stop and a restart")

	// SIGTERM, which Caddy handles as gracefully.
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	wait(cmd)
	cmd = start(true)
	if got := status(); got != 429 {
		t.Fatalf("after SIGTERM and a restart: %d, want 429", got)
	}
	banned("after SIGTERM and a restart")

	// SIGKILL, which nothing can handle: what the last periodic write
	// kept. A bucket loaded at the start is written at the next interval.
	time.Sleep(time.Second)
	if err := cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	wait(cmd)
	start(true)
	if got := status(); got != 429 {
		t.Fatalf("after SIGKILL and a restart: %d, want 429", got)
	}
	banned("after SIGKILL and a restart")
}
