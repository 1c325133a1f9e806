// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package memstore

import (
	"cmp"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io/fs"
	"net/netip"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/gcra"
	"github.com/caddy-tokenbucket/ratelimit/internal/siphash"
	"github.com/caddy-tokenbucket/ratelimit/internal/store"
	"github.com/caddyserver/certmagic"
	"go.uber.org/zap"
)

// testStorage is a Caddy storage in memory, for tests: certmagic.Storage
// is the module interface Caddy's storages (file system, Redis, Consul,
// S3…) implement. With hang set, every call blocks forever, ignoring its
// context, as a storage whose server stopped answering might; with fail
// set, every call fails.
type testStorage struct {
	mu    sync.Mutex
	loads int
	files map[string][]byte
	hang  chan struct{} // never closed
	fail  error
}

func newTestStorage() *testStorage { return &testStorage{files: map[string][]byte{}} }

func (s *testStorage) wait() error {
	if s.hang != nil {
		<-s.hang
	}
	return s.fail
}

func (s *testStorage) Store(_ context.Context, key string, value []byte) error {
	if err := s.wait(); err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.files[key] = append([]byte(nil), value...)
	return nil
}

func (s *testStorage) Load(_ context.Context, key string) ([]byte, error) {
	s.mu.Lock()
	s.loads++
	s.mu.Unlock()
	if err := s.wait(); err != nil {
		return nil, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	b, ok := s.files[key]
	if !ok {
		return nil, fs.ErrNotExist
	}
	return b, nil
}

func (s *testStorage) Delete(_ context.Context, key string) error {
	if err := s.wait(); err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.files, key)
	return nil
}

func (s *testStorage) Exists(_ context.Context, key string) bool {
	_, err := s.Load(context.Background(), key)
	return err == nil
}

func (s *testStorage) List(context.Context, string, bool) ([]string, error) {
	return nil, errors.New("not needed")
}

func (s *testStorage) Stat(context.Context, string) (certmagic.KeyInfo, error) {
	return certmagic.KeyInfo{}, errors.New("not needed")
}
func (s *testStorage) Lock(context.Context, string) error   { return nil }
func (s *testStorage) Unlock(context.Context, string) error { return nil }

func (s *testStorage) file(key string) ([]byte, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	b, ok := s.files[key]
	return b, ok
}

var testShape = TableID{name: "z", tokenTime: time.Second, burst: 10}

// newPersistedTable is a table of testShape persisted to sn, without
// its background loading and writing.
func newPersistedTable(sn *Snapshots) *Table[Bucket] { return newPersistedTableOf(sn, 1000) }

func newPersistedTableOf(sn *Snapshots, maxKeys int64) *Table[Bucket] {
	t := NewBuckets(maxKeys, tm0)
	t.key = sn.Key
	t.p = &persistence{shape: testShape, name: testShape.snapshotName(), ready: make(chan struct{}), done: make(chan struct{})}
	t.p.to.Store(sn)
	return t
}

func testSnapshots(storage certmagic.Storage) *Snapshots {
	return &Snapshots{Storage: storage, Dir: "rate_limit/test", Key: siphash.NewKey(), Interval: time.Second, Logger: zap.NewNop()}
}

// set makes k's bucket in t full again at fullAt.
func set(t *Table[Bucket], k string, fullAt time.Time) {
	raise(t, keyOf(k), gcra.NewLimit(1, 10), t.Instant(fullAt), t.Instant(tm0)) // testShape's limit
}

// fullIn is how long k's bucket in t needs to be full again, seen at now.
func fullIn(t *Table[Bucket], k string, now time.Time) time.Duration {
	return max(BucketAt(t, keyOf(k))-t.Instant(now), 0)
}

func TestSnapshotRoundTrip(t *testing.T) {
	sn := testSnapshots(newTestStorage())
	a := newPersistedTable(sn)
	set(a, "empty", tm0.Add(10*time.Second))
	set(a, "half", tm0.Add(5*time.Second))
	set(a, "soon", tm0.Add(time.Second))
	set(a, "full", tm0) // refilled: not written
	b := a.snapshot(tm0, fingerprint(sn.Key))
	if got, want := len(b), snapshotHeader+3*snapshotEntry+overridesHeader; got != want {
		t.Fatalf("snapshot of 3 buckets that are not full: %d bytes, want %d", got, want)
	}

	// Loaded 2s later into a table of another epoch: "soon" has refilled.
	later := tm0.Add(2 * time.Second)
	c := newPersistedTable(sn)
	c.epoch = tm0.Add(-time.Hour)
	kept, err := c.merge(b, fingerprint(sn.Key), later)
	if err != nil {
		t.Fatal(err)
	}
	if kept != 2 || c.size() != 2 {
		t.Fatalf("kept %d, table holds %d; want 2 and 2", kept, c.size())
	}
	for k, want := range map[string]time.Duration{"empty": 8 * time.Second, "half": 3 * time.Second, "soon": 0, "full": 0} {
		if got := fullIn(c, k, later); got != want {
			t.Errorf("%s: full in %v, want %v", k, got, want)
		}
	}
}

// A snapshot of another shape, key or format is discarded whole.
func TestSnapshotDiscarded(t *testing.T) {
	sn := testSnapshots(newTestStorage())
	a := newPersistedTable(sn)
	set(a, "k", tm0.Add(5*time.Second))
	good := a.snapshot(tm0, fingerprint(sn.Key))

	with := func(off int, v uint64) []byte {
		b := append([]byte(nil), good...)
		binary.LittleEndian.PutUint64(b[off:], v)
		return b
	}
	for _, tc := range []struct {
		name    string
		b       []byte
		wantErr string
	}{
		{"another rate", with(16, uint64(2*time.Second)), "rate or burst changed"},
		{"another burst", with(24, 11), "rate or burst changed"},
		{"another hash key", with(8, 1), "another key"},
		{"truncated", good[:len(good)-1], "truncated"},
		{"empty", nil, "not a snapshot"},
		{"another format", append([]byte("RLBK"), good[4:]...), "not a snapshot"},
		{"a later version", func() []byte {
			b := append([]byte(nil), good...)
			binary.LittleEndian.PutUint32(b[4:], snapshotVersion+1)
			return b
		}(), fmt.Sprintf("version %d", snapshotVersion+1)},
	} {
		c := newPersistedTable(sn)
		_, err := c.merge(tc.b, fingerprint(sn.Key), tm0)
		if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
			t.Errorf("%s: error %v, want one containing %q", tc.name, err, tc.wantErr)
		}
		if c.size() != 0 {
			t.Errorf("%s: %d buckets loaded", tc.name, c.size())
		}
	}
}

// The keys' own limits go into the snapshot and come back with their
// buckets, still under them; one that has ended does not; a snapshot of
// version 2, without them, still loads.
func TestSnapshotOverrides(t *testing.T) {
	sn := testSnapshots(newTestStorage())
	a := newPersistedTable(sn)
	a.base = gcra.NewLimit(1, 10) // testShape's
	own := store.Override{TokenTime: time.Second, Burst: 100, Rate: "1r/s"}
	for _, k := range []store.Key{keyOf("api-key"), {Net: netip.MustParsePrefix("2001:db8::/64")}} {
		if err := setOverride(a, k, own, 10, tm0); err != nil {
			t.Fatal(err)
		}
	}
	brief := own
	brief.Expires = tm0.Add(time.Second)
	if err := setOverride(a, keyOf("brief"), brief, 10, tm0); err != nil {
		t.Fatal(err)
	}
	// api-key takes 50 of its 100 tokens.
	c := charge{l: a.base, cost: time.Second, t: a, h: a.Hash(keyOf("api-key")), now: a.Instant(tm0)}
	for range 50 {
		if !takeOne(&c) || !c.overridden {
			t.Fatal("a take under the key's own limit was refused")
		}
	}
	b := a.snapshot(tm0, fingerprint(sn.Key))

	later := tm0.Add(2 * time.Second) // brief has ended; api-key has 2 tokens back
	loaded := newPersistedTable(sn)
	loaded.base = a.base
	if _, err := loaded.merge(b, fingerprint(sn.Key), later); err != nil {
		t.Fatal(err)
	}
	list := listOverrides(loaded, later)
	if len(list) != 2 || loaded.overrides.Load() != 2 {
		t.Fatalf("loaded overrides %v, want api-key's and the network's", list)
	}
	if o, ok := overrideOf(loaded, keyOf("api-key"), later); !ok || o != own {
		t.Fatalf("api-key's own limit %+v, %v; want %+v", o, ok, own)
	}
	ownLimit := own.Limit(a.base)
	if got := ownLimit.Tokens(fullIn(loaded, "api-key", later)); got != 52 {
		t.Fatalf("api-key holds %v tokens after the restart, want 52 of its 100", got)
	}

	// Version 2: the same buckets, no overrides.
	v2 := slices.Clone(b[:len(b)-overridesLen(b)])
	binary.LittleEndian.PutUint32(v2[4:], 2)
	old := newPersistedTable(sn)
	if kept, err := old.merge(v2, fingerprint(sn.Key), later); err != nil || kept != 1 || old.overrides.Load() != 0 {
		t.Fatalf("version 2: kept %d, %v, %d overrides; want 1, nil, 0", kept, err, old.overrides.Load())
	}
}

// A key whose own limit ends while Caddy is stopped, or ended before the
// stop with no request since, has its bucket carried back after the
// restart as it would have been without one: the tokens it spent under
// its own limit stay spent, counted in its own limit's tokens, and the
// zone's burst holds the rest (9 of 10 here), not an empty bucket of the
// zone's.
func TestSnapshotEndedOverrides(t *testing.T) {
	sn := testSnapshots(newTestStorage())
	base := gcra.NewLimit(1, 10) // testShape's: 1r/s burst 10
	for _, tc := range []struct {
		name               string
		ends, saved, loads time.Duration // after tm0, when the key spent 1 token under its own limit
	}{
		{"ends while stopped", 3 * time.Second, time.Second, 5 * time.Second},
		{"ended before the stop", time.Second, 2 * time.Second, 4 * time.Second},
	} {
		a := newPersistedTable(sn)
		a.base = base
		k := keyOf("slow")
		slow := store.Override{TokenTime: time.Hour, Burst: 1, Rate: "1r/h", Expires: tm0.Add(tc.ends)}
		if err := setOverride(a, k, slow, 10, tm0); err != nil {
			t.Fatal(err)
		}
		if c := (charge{l: base, cost: time.Second, t: a, h: a.Hash(k), now: a.Instant(tm0)}); !takeOne(&c) || !c.overridden {
			t.Fatalf("%s: the take under the key's own limit was refused", tc.name)
		}
		b := a.snapshot(tm0.Add(tc.saved), fingerprint(sn.Key))

		later := tm0.Add(tc.loads)
		loaded := newPersistedTable(sn)
		loaded.base = base
		if _, err := loaded.merge(b, fingerprint(sn.Key), later); err != nil {
			t.Fatal(err)
		}
		if list := listOverrides(loaded, later); len(list) != 0 {
			t.Fatalf("%s: listed %v after the limit's end", tc.name, list)
		}
		// Read as a GET reads it, then as the key's requests find it.
		fullAt, _, own := ownBucket(loaded, k, later)
		if got := base.Tokens(base.Debt(fullAt, loaded.Instant(later))); own || got < 9 || got > 9.01 {
			t.Fatalf("%s: the key reads %v tokens (own limit %v), want 9 of the zone's 10 and no own limit", tc.name, got, own)
		}
		allowed := 0
		for range 10 {
			c := charge{l: base, cost: time.Second, t: loaded, h: loaded.Hash(k), now: loaded.Instant(later)}
			if takeOne(&c) {
				allowed++
			}
			if c.overridden {
				t.Fatalf("%s: a take after the limit's end was decided by it", tc.name)
			}
		}
		if allowed != 9 {
			t.Fatalf("%s: %d of 10 requests allowed after the restart, want 9", tc.name, allowed)
		}
	}
}

// overridesLen is the length of a snapshot's overrides section.
func overridesLen(b []byte) int {
	n := binary.LittleEndian.Uint64(b[40:])
	return len(b) - snapshotHeader - int(n)*snapshotEntry
}

// A bucket used since the start keeps the emptier of its two states; no
// loaded bucket waits longer than a whole refill.
func TestMergeKeepsLaterInstant(t *testing.T) {
	sn := testSnapshots(newTestStorage())
	a := newPersistedTable(sn)
	set(a, "used more since", tm0.Add(2*time.Second))
	set(a, "used more before", tm0.Add(8*time.Second))
	set(a, "clock ahead", tm0.Add(time.Hour))
	b := a.snapshot(tm0, fingerprint(sn.Key))

	c := newPersistedTable(sn)
	set(c, "used more since", tm0.Add(6*time.Second))
	set(c, "used more before", tm0.Add(3*time.Second))
	if _, err := c.merge(b, fingerprint(sn.Key), tm0); err != nil {
		t.Fatal(err)
	}
	for k, want := range map[string]time.Duration{
		"used more since":  6 * time.Second,
		"used more before": 8 * time.Second,
		"clock ahead":      10 * time.Second, // burst 10 at 1r/s
	} {
		if got := fullIn(c, k, tm0); got != want {
			t.Errorf("%s: full in %v, want %v", k, got, want)
		}
	}
}

// Loaded buckets fill free room only: a full table evicts nothing for them.
func TestMergeEvictsNothing(t *testing.T) {
	sn := testSnapshots(newTestStorage())
	a := newPersistedTable(sn)
	for i := range 10 {
		set(a, fmt.Sprint("old", i), tm0.Add(5*time.Second))
	}
	b := a.snapshot(tm0, fingerprint(sn.Key))
	c := newPersistedTable(sn)
	c.maxKeys.Store(4)
	for i := range 3 {
		set(c, fmt.Sprint("new", i), tm0.Add(5*time.Second))
	}
	kept, err := c.merge(b, fingerprint(sn.Key), tm0)
	if err != nil {
		t.Fatal(err)
	}
	if kept != 1 || c.size() != 4 {
		t.Fatalf("kept %d, table holds %d; want 1 and 4", kept, c.size())
	}
	for i := range 3 {
		if fullIn(c, fmt.Sprint("new", i), tm0) == 0 {
			t.Errorf("new%d was evicted", i)
		}
	}
}

// bindTestStore binds a store persisted to sn to one zone of rate 1r/m
// and burst 2, on tables made as the local store module makes them.
func bindTestStore(t *testing.T, sn *Snapshots, zone string) (testStore, gcra.Limit) {
	t.Helper()
	l := gcra.NewLimit(1.0/60, 2)
	ts := &testTables{sn: sn}
	s, err := New([]store.ZoneSpec{{Name: zone, Bucket: true, Shape: l}}, ts)
	if err != nil {
		t.Fatal(err)
	}
	return testStore{s, ts}, l
}

// A testStore is a store and the tables it was made on.
type testStore struct {
	*Store
	*testTables
}

// testTables make the tables of a store's zones, persisted to sn, as the
// local store module makes them (without sharing them with other
// configs), and destroy them at Cleanup.
type testTables struct {
	sn      *Snapshots
	maxKeys int64 // 0: 1000
	made    []interface{ Destruct() error }
}

func (ts *testTables) Buckets(id TableID, most time.Duration) (*Table[Bucket], error) {
	return addTable(ts, NewTable[Bucket](cmp.Or(ts.maxKeys, 1000), time.Now()), id, most), nil
}

func (ts *testTables) Counters(id TableID) (*Table[Counter], error) {
	return addTable(ts, NewTable[Counter](cmp.Or(ts.maxKeys, 1000), time.Now()), id, 0), nil
}

func (ts *testTables) Slots(string) (*SlotTable, error) { return NewSlotTable(1000), nil }

func addTable[E Entry](ts *testTables, t *Table[E], id TableID, most time.Duration) *Table[E] {
	if ts.sn != nil {
		t.Persist(ts.sn, id, most)
	}
	go t.SweepLoop()
	ts.made = append(ts.made, t)
	return t
}

// Cleanup destroys the tables, as the module's pool does when no config
// uses them.
func (ts *testTables) Cleanup() error {
	var errs []error
	for _, t := range ts.made {
		errs = append(errs, t.Destruct())
	}
	return errors.Join(errs...)
}

// spend takes a token of k's bucket, of limit l, in s's zone and reports
// whether the request was allowed.
func spend(t *testing.T, s testStore, l gcra.Limit, k string) bool {
	t.Helper()
	d := &store.Demands{Buckets: []store.BucketDemand{{Zone: 0, Key: keyOf(k), Limit: l, Cost: l.CostTime(1)}}}
	ok, err := s.Take(context.Background(), time.Now(), d)
	if err != nil {
		t.Fatal(err)
	}
	return ok
}

// within fails the test unless f returns within a minute: the thing
// under test must not wait for a storage that hangs.
func within(t *testing.T, what string, f func()) {
	t.Helper()
	done := make(chan struct{})
	go func() { defer close(done); f() }()
	select {
	case <-done:
	case <-time.After(time.Minute):
		t.Fatalf("%s waited for a storage that hangs", what)
	}
}

// A storage that hangs holds up neither the start, nor requests, nor the
// stop: the table serves from full buckets meanwhile.
func TestHangingStorageBlocksNothing(t *testing.T) {
	storage := newTestStorage()
	storage.hang = make(chan struct{})
	var s testStore
	var z gcra.Limit
	within(t, "bind", func() { s, z = bindTestStore(t, testSnapshots(storage), "hanging") })
	within(t, "requests", func() {
		if !spend(t, s, z, "k") || !spend(t, s, z, "k") || spend(t, s, z, "k") {
			t.Error("a bucket of 2 did not allow exactly 2 requests")
		}
	})
	within(t, "cleanup", func() {
		if err := s.Cleanup(); err != nil {
			t.Error(err)
		}
	})
	// The local stores of one config share its storage, which is asked
	// once: a config of many sites is not held up once per site.
	var cache HashKeyCache
	for range 3 {
		within(t, "reading the hash key", func() {
			if _, _, err := cache.Get(storage, "k"); err == nil {
				t.Error("reading the hash key from a storage that hangs did not fail")
			}
		})
	}
	storage.mu.Lock()
	defer storage.mu.Unlock()
	if storage.loads != 2 { // the snapshot, and the hash key once
		t.Errorf("the storage was read %d times, want 2", storage.loads)
	}
}

// A storage that fails leaves the buckets full and in memory.
func TestFailingStorage(t *testing.T) {
	storage := newTestStorage()
	storage.fail = errors.New("storage down")
	s, z := bindTestStore(t, testSnapshots(storage), "failing")
	if !spend(t, s, z, "k") {
		t.Error("first request denied")
	}
	tab := s.zones[0].buckets
	<-tab.p.ready
	if err := tab.save(tab.p.to.Load()); err == nil || !strings.Contains(err.Error(), "storage down") {
		t.Errorf("save: %v, want the storage's error", err)
	}
	if _, err := LoadHashKey(storage, "k"); err == nil {
		t.Error("reading the hash key from a failing storage did not fail")
	}
	if err := s.Cleanup(); err != nil {
		t.Error(err)
	}
}

// The hash key is created once, then read back.
func TestHashKeyStored(t *testing.T) {
	storage := newTestStorage()
	k1, err := LoadHashKey(storage, "rate_limit/x/hash_key")
	if err != nil {
		t.Fatal(err)
	}
	k2, err := LoadHashKey(storage, "rate_limit/x/hash_key")
	if err != nil {
		t.Fatal(err)
	}
	if k1 != k2 || k1 == (siphash.Key{}) {
		t.Errorf("keys %x then %x, want one nonzero key", k1, k2)
	}
}

// The table is written every interval, loaded by the next table of its
// shape, saved when Caddy exits and deleted when a reload drops it.
func TestPersistLifecycle(t *testing.T) {
	storage := newTestStorage()
	sn := testSnapshots(storage)
	sn.Interval = 100 * time.Millisecond
	s, z := bindTestStore(t, sn, "lifecycle")
	spend(t, s, z, "k")
	spend(t, s, z, "k")
	name := sn.Dir + "/" + s.zones[0].buckets.p.name
	deadline := time.Now().Add(time.Minute)
	for {
		if b, ok := storage.file(name); ok && len(b) == snapshotHeader+snapshotEntry+overridesHeader {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the table was not written within a minute")
		}
		time.Sleep(10 * time.Millisecond)
	}
	// As at a restart: the table is saved as Caddy exits, and another
	// of its shape loads it.
	tab := s.zones[0].buckets
	tab.stopOnce.Do(func() {
		close(tab.stop)
		closePersisted(tab, true)
	})
	if err := s.Cleanup(); err != nil {
		t.Fatal(err)
	}

	s2, z2 := bindTestStore(t, sn, "lifecycle")
	<-s2.zones[0].buckets.p.ready
	if spend(t, s2, z2, "k") {
		t.Error("a bucket emptied before the restart allowed a request")
	}
	if !spend(t, s2, z2, "other") {
		t.Error("another client was denied")
	}
	// A config that is dropped before it wrote (a failed start, caddy
	// validate) leaves the snapshot alone; a reload that drops the zone
	// after it wrote deletes it.
	s2.zones[0].buckets.stopOnce.Do(func() {
		close(s2.zones[0].buckets.stop)
		closePersisted(s2.zones[0].buckets, false)
	})
	if _, ok := storage.file(name); !ok {
		t.Error("a config that never wrote deleted the snapshot")
	}
	if err := s2.zones[0].buckets.save(sn); err != nil {
		t.Fatal(err)
	}
	closePersisted(s2.zones[0].buckets, false)
	if _, ok := storage.file(name); ok {
		t.Error("the snapshot of a dropped zone was kept")
	}
	if err := s2.Cleanup(); err != nil {
		t.Fatal(err)
	}
}

// BenchmarkSnapshot is writing and loading a table of a million buckets
// that are not full: time, bytes and allocations per snapshot.
func BenchmarkSnapshot(b *testing.B) {
	sn := testSnapshots(newTestStorage())
	tab := newPersistedTableOf(sn, 2*manyKeys)
	now := tm0
	for i, k := range ipKeys()[:1_000_000] {
		h := tab.Hash(k)
		tab.shard(h).set(tab, h, Bucket{tab.Instant(now) + time.Duration(i+1)*time.Millisecond, 0, 10 * time.Second}, 0)
	}
	var snap []byte
	b.Run("write", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			snap = tab.snapshot(now, fingerprint(sn.Key))
		}
		b.ReportMetric(float64(len(snap)), "snapshot-bytes")
	})
	// What a request may wait for: one shard's copy, under its lock.
	b.Run("one-shard-locked", func(b *testing.B) {
		b.ReportAllocs()
		buf := make([]byte, 0, 2*len(snap)/len(tab.shards))
		n, wall := tab.Instant(now), now.UnixNano()
		i := 0
		for b.Loop() {
			s := &tab.shards[i%len(tab.shards)]
			s.mu.Lock()
			buf = s.appendTo(buf[:0], n, wall, false)
			s.mu.Unlock()
			i++
		}
	})
	b.Run("load", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			b.StopTimer()
			c := newPersistedTableOf(sn, 2*manyKeys)
			b.StartTimer()
			if _, err := c.merge(snap, fingerprint(sn.Key), now); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// A zone's name is free text: whatever it holds, its snapshot is one file
// in the instance's folder of Caddy's storage, and plain names keep the
// snapshot names that earlier versions wrote.
func TestSnapshotNamesEscaped(t *testing.T) {
	root := t.TempDir()
	storage := &certmagic.FileStorage{Path: filepath.Join(root, "storage")}
	sn := testSnapshots(storage)
	names := []string{"../../../../../../../../" + root + "/escaped", "a/b", `c\d`, "50%", "api"}
	var tables []*Table[Bucket]
	for _, name := range names {
		shape := TableID{name: name, tokenTime: time.Second, burst: 10}
		tab := NewBuckets(1000, tm0)
		tab.key = sn.Key
		tab.p = &persistence{shape: shape, name: shape.snapshotName(), ready: make(chan struct{}), done: make(chan struct{})}
		tab.p.to.Store(sn)
		set(tab, "k", time.Now().Add(time.Hour))
		if err := tab.save(sn); err != nil {
			t.Fatalf("zone %q: %v", name, err)
		}
		tables = append(tables, tab)
	}
	var files []string
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err == nil && !d.IsDir() {
			rel, _ := filepath.Rel(root, path)
			files = append(files, filepath.ToSlash(rel))
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	dir := "storage/rate_limit/test/buckets/"
	want := []string{
		dir + "..%2F..%2F..%2F..%2F..%2F..%2F..%2F..%2F" + strings.ReplaceAll(root, "/", "%2F") + "%2Fescaped.10.1000000000",
		dir + "50%25.10.1000000000",
		dir + "a%2Fb.10.1000000000",
		dir + "api.10.1000000000",
		dir + `c%5Cd.10.1000000000`,
	}
	slices.Sort(files)
	slices.Sort(want)
	if !slices.Equal(files, want) {
		t.Fatalf("snapshot files:\n%s\nwant:\n%s", strings.Join(files, "\n"), strings.Join(want, "\n"))
	}
	// Each loads back into its own zone.
	for i, tab := range tables {
		b, err := storage.Load(context.Background(), sn.Dir+"/"+tab.p.name)
		if err != nil {
			t.Fatal(err)
		}
		fresh := NewBuckets(1000, tm0)
		fresh.key, fresh.p = sn.Key, tab.p
		if n, err := fresh.merge(b, fingerprint(sn.Key), time.Now()); err != nil || n != 1 {
			t.Fatalf("zone %q: loaded %d buckets, %v", names[i], n, err)
		}
	}
}

// TestQuotaSnapshot: a quota table's counters go to the snapshot with
// their counts; loaded, those of ended windows are dropped, and a
// counter used since the start adds the snapshot's count to its own.
func TestQuotaSnapshot(t *testing.T) {
	sn := testSnapshots(newTestStorage())
	shape := TableID{name: "zq", quota: "month@Europe/Paris"}
	if got := shape.snapshotName(); got != "quotas/zq.month@Europe-Paris" {
		t.Fatalf("snapshot name %q", got)
	}
	newQuotaTable := func() *Table[Counter] {
		qt := NewCounters(1000, tm0)
		qt.key = sn.Key
		qt.p = &persistence{shape: shape, name: shape.snapshotName(), ready: make(chan struct{}), done: make(chan struct{})}
		return qt
	}
	setCount := func(qt *Table[Counter], k string, used int64, end time.Time) {
		h := qt.Hash(keyOf(k))
		s := qt.shard(h)
		s.mu.Lock()
		s.set(qt, h, Counter{qt.Instant(end), used}, qt.Instant(tm0))
		s.mu.Unlock()
	}
	a := newQuotaTable()
	setCount(a, "month", 7, tm0.Add(10*24*time.Hour))
	setCount(a, "both", 2, tm0.Add(10*24*time.Hour))
	setCount(a, "ending", 5, tm0.Add(time.Second))
	b := a.snapshot(tm0, fingerprint(sn.Key))
	if got, want := len(b), snapshotHeader+3*(snapshotEntry+8); got != want {
		t.Fatalf("snapshot of 3 counters: %d bytes, want %d", got, want)
	}

	later := tm0.Add(2 * time.Second) // "ending"'s window has ended
	c := newQuotaTable()
	c.epoch = tm0.Add(-time.Hour)
	setCount(c, "both", 3, tm0.Add(10*24*time.Hour))
	kept, err := c.merge(b, fingerprint(sn.Key), later)
	if err != nil || kept != 2 {
		t.Fatalf("kept %d, %v; want 2", kept, err)
	}
	for k, want := range map[string]int64{"month": 7, "both": 5, "ending": 0} {
		used, end := CountAt(c, keyOf(k), c.Instant(later))
		if used != want {
			t.Errorf("%s: count %d, want %d", k, used, want)
		}
		if used > 0 && end != c.Instant(tm0.Add(10*24*time.Hour)) {
			t.Errorf("%s: window ends at %v", k, end)
		}
	}
}
