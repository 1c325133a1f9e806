// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/caddytest"
)

// The fault and attack scenarios of faults_test.go come in two sizes. The
// short one runs with every `go test`. The long one, RATELIMIT_FAULTS=long
// (`make faults`), holds each fault longer, sends more, asserts the exact
// bounds, and appends its figures to the file RATELIMIT_FAULTS_REPORT
// names. With RATELIMIT_FAULTS_CADDY naming a Caddy built from ./cmd/caddy,
// the scenarios that watch a Caddy's logs or memory run that binary as a
// process of its own, whose stderr also holds what go-redis logs by itself;
// otherwise they use the Caddy in the test binary, as caddytest does.

func longFaults() bool { return os.Getenv("RATELIMIT_FAULTS") == "long" }

// sized picks a parameter's short or long value.
func sized[T any](short, long T) T {
	if longFaults() {
		return long
	}
	return short
}

// faultReport is a table of a scenario's figures: logged, and in the
// long version appended as Markdown to $RATELIMIT_FAULTS_REPORT.
type faultReport struct {
	mu    sync.Mutex
	title string
	head  []string
	rows  [][]string
}

func newFaultReport(t *testing.T, title string, columns ...string) *faultReport {
	r := &faultReport{title: title, head: columns}
	t.Cleanup(func() { r.write(t) })
	return r
}

func (r *faultReport) add(t *testing.T, cells ...any) {
	t.Helper()
	row := make([]string, len(cells))
	for i, c := range cells {
		row[i] = fmt.Sprint(c)
	}
	r.mu.Lock()
	r.rows = append(r.rows, row)
	r.mu.Unlock()
	var b strings.Builder
	b.WriteString("figures: ")
	for i, c := range row {
		fmt.Fprintf(&b, "%s=%s ", r.head[i], c)
	}
	t.Log(b.String())
}

func (r *faultReport) write(t *testing.T) {
	path := os.Getenv("RATELIMIT_FAULTS_REPORT")
	if path == "" || !longFaults() || len(r.rows) == 0 {
		return
	}
	var b strings.Builder
	fmt.Fprintf(&b, "\n### %s\n\n| %s |\n|%s\n", r.title, strings.Join(r.head, " | "), strings.Repeat(" --- |", len(r.head)))
	for _, row := range r.rows {
		fmt.Fprintf(&b, "| %s |\n", strings.Join(row, " | "))
	}
	if t.Failed() {
		b.WriteString("\n**This scenario failed**; see the test log.\n")
	}
	f, err := os.OpenFile(path, os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o644)
	if err != nil {
		t.Error(err)
		return
	}
	defer f.Close()
	if _, err := f.WriteString(b.String()); err != nil {
		t.Error(err)
	}
}

// ms formats a duration in milliseconds for the reports.
func ms(d time.Duration) string { return strconv.FormatFloat(float64(d)/1e6, 'f', 1, 64) + " ms" }

// faultCaddy is a Caddy serving one site whose directives a scenario
// gives, with its logs going to a file the scenario reads.
type faultCaddy struct {
	t      *testing.T
	url    string // the site, http://localhost:<port>
	admin  string // the admin API, localhost:<port>
	global string // the global options block
	pid    int
	logs   *logWatch
	client *http.Client // for loads
}

// startFaultCaddy starts a Caddy with the site, as a process when
// RATELIMIT_FAULTS_CADDY names a binary and ownProcess allows it, else in
// this test binary.
func startFaultCaddy(t *testing.T, site string, ownProcess bool) *faultCaddy {
	t.Helper()
	if testing.Short() {
		t.Skip("starts Caddy")
	}
	dir := t.TempDir()
	logPath := filepath.Join(dir, "caddy.log")
	c := &faultCaddy{t: t, client: &http.Client{Timeout: 30 * time.Second}}
	bin := os.Getenv("RATELIMIT_FAULTS_CADDY")
	if bin == "" || !ownProcess {
		// caddytest's Caddy: the package's test ports (pickTestPorts),
		// shared by the package's tests, which therefore never run in
		// parallel.
		c.admin, c.url, c.pid = adminAddr, siteURL, os.Getpid()
		c.global = faultGlobal(adminPort, httpPort, httpsPort, "file "+logPath)
		tester := caddytest.NewTester(t)
		tester.InitServer(c.config(site), "caddyfile")
		if t.Failed() {
			t.FailNow()
		}
		waitLoaded(t, tester)
		c.logs = watchLog(t, logPath)
		return c
	}
	return startCaddyProcess(t, bin, site)
}

// startCaddyProcess runs the Caddy binary bin as a process of its own,
// on free ports, serving one site whose directives are given, with its
// stderr (its logs) going to a file the caller reads. It is stopped with
// SIGTERM when the test ends. A Caddy that exits before it answers fails
// the test with its log, unless another process took one of its ports
// first: then it starts again on others.
func startCaddyProcess(t *testing.T, bin, site string) *faultCaddy {
	t.Helper()
	for try := 1; ; try++ {
		c, log := tryCaddyProcess(t, bin, site)
		if c != nil {
			return c
		}
		if !strings.Contains(log, "address already in use") || try == 3 {
			t.Fatalf("Caddy %s exited before it answered; its log:\n%s", bin, log)
		}
	}
}

// tryCaddyProcess starts the Caddy and waits until it answers; if it
// exits first, it returns its log instead.
func tryCaddyProcess(t *testing.T, bin, site string) (*faultCaddy, string) {
	t.Helper()
	dir := t.TempDir()
	logPath := filepath.Join(dir, "caddy.log")
	c := &faultCaddy{t: t, client: &http.Client{Timeout: 30 * time.Second}}
	admin, port, tls := freePort(t, 0), freePort(t, 0), freePort(t, 0)
	c.admin, c.url = fmt.Sprintf("localhost:%d", admin), fmt.Sprintf("http://localhost:%d", port)
	c.global = faultGlobal(admin, port, tls, "stderr")
	cfg := writeFile(t, dir, "Caddyfile", c.config(site))
	logFile, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, "run", "--config", cfg, "--adapter", "caddyfile")
	cmd.Env = append(os.Environ(), "XDG_CONFIG_HOME="+filepath.Join(dir, "config"), "XDG_DATA_HOME="+filepath.Join(dir, "data"))
	cmd.Stdout, cmd.Stderr = logFile, logFile
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); logFile.Close(); close(exited) }()
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-exited:
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Kill()
			<-exited
		}
	})
	c.pid = cmd.Process.Pid
	c.logs = watchLog(t, logPath)
	gone := false
	waitFor(t, 60*time.Second, "Caddy "+bin+" to answer", func() bool {
		select {
		case <-exited:
			gone = true
			return true
		default:
		}
		resp, err := c.client.Get(c.url)
		if err == nil {
			resp.Body.Close()
		}
		return err == nil
	})
	if gone {
		b, _ := os.ReadFile(logPath)
		return nil, string(b)
	}
	return c, ""
}

// faultGlobal is the global options block. The grace period lets the
// requests running at a reload finish, as in production: Caddy closes
// the connections that outlive it.
func faultGlobal(admin, port, tls int, output string) string {
	return fmt.Sprintf(`{
	skip_install_trust
	admin localhost:%d
	http_port %d
	https_port %d
	grace_period 10s
	persist_config off
	log {
		output %s
		format json
	}
}
`, admin, port, tls, output)
}

func (c *faultCaddy) config(site string) string {
	return c.global + "\n" + c.url + " {\n" + site + "\n}\n"
}

// load replaces the running config by one with the site, as `caddy
// reload` does.
func (c *faultCaddy) load(site string) {
	c.t.Helper()
	resp, err := c.client.Post("http://"+c.admin+"/load", "text/caddyfile", strings.NewReader(c.config(site)))
	if err != nil {
		c.t.Fatalf("reload: %v", err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		c.t.Fatalf("reload: %d %s", resp.StatusCode, body)
	}
}

// fds is how many file descriptors the Caddy has open.
func (c *faultCaddy) fds() int {
	entries, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", c.pid))
	if err != nil {
		c.t.Fatal(err)
	}
	return len(entries)
}

// rssKB is the Caddy's resident memory.
func (c *faultCaddy) rssKB() int64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", c.pid))
	if err != nil {
		c.t.Fatal(err)
	}
	for line := range strings.SplitSeq(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			n, _ := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			return n
		}
	}
	c.t.Fatal("no VmRSS")
	return 0
}

// logWatch follows a log file and notes when each line appeared, to a
// twentieth of a second.
type logWatch struct {
	mu    sync.Mutex
	lines []logLine
}

type logLine struct {
	at   time.Time
	text string
}

func watchLog(t *testing.T, path string) *logWatch {
	w := &logWatch{}
	stop, done := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		var off int64
		var partial []byte
		tick := time.NewTicker(50 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-stop:
				return
			case now := <-tick.C:
				b, err := readFrom(path, off)
				if err != nil || len(b) == 0 {
					continue
				}
				off += int64(len(b))
				partial = append(partial, b...)
				w.mu.Lock()
				for {
					i := bytes.IndexByte(partial, '\n')
					if i < 0 {
						break
					}
					w.lines = append(w.lines, logLine{now, string(partial[:i])})
					partial = partial[i+1:]
				}
				w.mu.Unlock()
			}
		}
	}()
	t.Cleanup(func() { close(stop); <-done })
	return w
}

func readFrom(path string, off int64) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	if _, err := f.Seek(off, io.SeekStart); err != nil {
		return nil, err
	}
	return io.ReadAll(f)
}

// mark is the number of lines seen so far: the start of a window.
func (w *logWatch) mark() int {
	time.Sleep(100 * time.Millisecond) // let the watcher catch up
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.lines)
}

// since returns the lines seen after mark.
func (w *logWatch) since(mark int) []logLine {
	time.Sleep(100 * time.Millisecond)
	w.mu.Lock()
	defer w.mu.Unlock()
	return slices.Clone(w.lines[mark:])
}

// perSecond is the most lines that appeared within any one second.
func perSecond(lines []logLine) int {
	most := 0
	for i, j := 0, 0; j < len(lines); j++ {
		for lines[j].at.Sub(lines[i].at) >= time.Second {
			i++
		}
		most = max(most, j-i+1)
	}
	return most
}

// leaks returns the lines holding any of the strings.
func leaks(lines []logLine, secrets ...string) []string {
	var found []string
	for _, l := range lines {
		for _, s := range secrets {
			if strings.Contains(strings.ToLower(l.text), strings.ToLower(s)) {
				found = append(found, l.text)
				break
			}
		}
	}
	return found
}

// newFaultClient is an HTTP client with room for many connections to
// one host; impatient clients give it a short timeout.
func newFaultClient(t *testing.T, timeout time.Duration) *http.Client {
	tr := &http.Transport{MaxIdleConnsPerHost: 1024, DisableCompression: true}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr, Timeout: timeout}
}

// sendOnceMore sends like send, and once more when the connection was
// reset or closed before a response came, as browsers do: clients must
// expect that of a server that closes kept-alive connections (Caddy does
// at a reload), and the loopback of a saturated 2-core machine resets
// the odd connection too, with or without this handler. A second failure
// counts; resent counts the requests sent again.
func sendOnceMore(c *http.Client, resent *atomic.Int64, url string, header ...string) reply {
	rep := send(c, url, header...)
	if errors.Is(rep.err, io.EOF) || errors.Is(rep.err, syscall.ECONNRESET) {
		resent.Add(1)
		rep = send(c, url, header...)
	}
	return rep
}

// reply is what a client got for one request.
type reply struct {
	status     int // 0: no HTTP response
	retryAfter string
	took       time.Duration
	err        error
}

// send requests url with the header name/value pairs and reads the whole
// response.
func send(c *http.Client, url string, header ...string) reply {
	req, err := http.NewRequest(http.MethodGet, url, nil)
	if err != nil {
		return reply{err: err}
	}
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	start := time.Now()
	resp, err := c.Do(req)
	if err != nil {
		return reply{took: time.Since(start), err: err}
	}
	_, err = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return reply{status: resp.StatusCode, retryAfter: resp.Header.Get("Retry-After"), took: time.Since(start), err: err}
}

// tally counts what a group of clients got.
type tally struct {
	mu           sync.Mutex
	codes        map[int]int
	slowest      time.Duration
	errs         int
	firstErr     error
	noRetryAfter int // 503s without Retry-After: 1
}

func newTally() *tally { return &tally{codes: map[int]int{}} }

func (ta *tally) note(r reply) {
	ta.mu.Lock()
	defer ta.mu.Unlock()
	ta.slowest = max(ta.slowest, r.took)
	if r.err != nil {
		if ta.errs++; ta.firstErr == nil {
			ta.firstErr = r.err
		}
		return
	}
	ta.codes[r.status]++
	if r.status == http.StatusServiceUnavailable && r.retryAfter != "1" {
		ta.noRetryAfter++
	}
}

func (ta *tally) total() int {
	ta.mu.Lock()
	defer ta.mu.Unlock()
	n := ta.errs
	for _, c := range ta.codes {
		n += c
	}
	return n
}

// codesString lists the statuses in order, e.g. "200×12 429×3".
func (ta *tally) codesString() string {
	ta.mu.Lock()
	defer ta.mu.Unlock()
	var keys []int
	for k := range ta.codes {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	var parts []string
	for _, k := range keys {
		parts = append(parts, fmt.Sprintf("%d×%d", k, ta.codes[k]))
	}
	if ta.errs > 0 {
		parts = append(parts, fmt.Sprintf("errors×%d", ta.errs))
	}
	return strings.Join(parts, " ")
}

// loop runs f in n goroutines until stop is closed, pausing pace between
// calls; the returned function waits for them.
func loop(n int, pace time.Duration, stop <-chan struct{}, f func(worker, i int)) (wait func()) {
	var wg sync.WaitGroup
	for w := range n {
		wg.Go(func() {
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				f(w, i)
				if pace > 0 {
					time.Sleep(pace)
				}
			}
		})
	}
	return wg.Wait
}
