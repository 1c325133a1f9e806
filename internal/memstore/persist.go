// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package memstore

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io/fs"
	"net/netip"
	"reflect"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/gcra"
	"github.com/caddy-tokenbucket/ratelimit/internal/siphash"
	"github.com/caddy-tokenbucket/ratelimit/internal/store"
	"go.uber.org/zap"
)

// The local store's buckets outlive a restart through Caddy's storage
// (where certificates live: the file system by default, or Redis, Consul,
// S3… as configured), so that a deploy or a crash does not hand every
// client, the abusive ones included, a full bucket.
//
// Each table (a zone's buckets: name, rate and burst) is written as a
// snapshot when Caddy exits (caddy stop, SIGINT, SIGTERM, the admin API's
// /stop) and every persist_interval, so a crash loses at most that
// interval. A snapshot holds only the buckets that are not full, each as
// its key's hash and the wall-clock instant it is full again: 16 bytes.
// Tables hash keys with a secret key of this Caddy instance, kept in the
// storage beside the snapshots, so the hashes mean the same after a
// restart and a loaded bucket simply goes back into the table.
//
// Loading never holds up startup: it runs in the background while the
// table already serves, and merges, keeping the later instant of a bucket
// used meanwhile, the emptier of the two. Buckets that have refilled in
// the meantime are dropped. A snapshot of another shape (the zone's rate
// or burst changed) has another name, so the zone starts full, as a
// reload makes it start; and a table that a reload drops has its
// snapshot deleted, as its buckets are.
//
// Storage layout, per instance (caddy.InstanceID, kept in Caddy's data
// directory):
//
//	rate_limit/<instance id>/hash_key                   16 bytes: the hash key
//	rate_limit/<instance id>/buckets/<zone>.<burst>.<ns per token>
//
// where <zone> is the zone's name with '/', '%' and the like escaped
// (storageName).
//
// A zone whose limit depends on the request (plans) has one table
// whatever its plans, named and written with a burst and token time of 0.
//
// A snapshot is, little-endian: the magic "rlbk", a uint32 version (3),
// the hash key's fingerprint (uint64), the token time in ns and the
// burst (int64), the wall-clock instant it was written and the number of
// buckets (int64, uint64), then per bucket its hash (uint64) and the Unix
// time in ns it is full again (int64), and, in a zone whose limit comes
// with each request, the whole-bucket time of the limit that wrote it
// (int64; version 1 has none). A quota's counter has, after its window's
// end, its count (int64). Then (version 3) the keys' own limits
// (overrides.go), with those that have ended while their bucket is not
// full: their number (uint64), and each one's token time in ns
// and burst (int64), the Unix time in ns it ends (int64, 0 for never),
// its rate as given (a uint16 length, then the bytes), and its key: 1 and
// an IP network in CIDR notation, or 0 and the key's text (a uint32
// length, then the bytes). Unlike the buckets' hashes, these keys are
// stored as they are: an operator named them, and lists them.

const (
	// defaultPersistInterval is how often tables are written: how much
	// a crash can lose.
	DefaultPersistInterval = 30 * time.Second

	// Storage calls give up after these, whether or not the storage
	// honours its context: a storage that hangs must not hang Caddy.
	hashKeyTimeout = 2 * time.Second // at provision, so in the config load
	loadTimeout    = 30 * time.Second
	saveTimeout    = 5 * time.Second

	snapshotMagic   = "rlbk"
	snapshotVersion = 3  // 1: a plan zone's buckets without their whole-bucket time; 2: no overrides
	snapshotHeader  = 48 // bytes before the buckets
	snapshotEntry   = 16
	overridesHeader = 8 // their number, after a bucket table's entries
)

// Snapshots is where a local store's tables are kept: a Caddy storage,
// this instance's folder in it, and the hash key stored there.
type Snapshots struct {
	Storage  Storage
	Dir      string // rate_limit/<instance id>
	Key      siphash.Key
	Interval time.Duration
	Logger   *zap.Logger
	Exiting  func() bool // reports whether the process is exiting (caddy.Exiting)
}

// A Storage is where snapshots are kept: Caddy's storage
// (certmagic.Storage) is one.
type Storage interface {
	Load(ctx context.Context, key string) ([]byte, error)
	Store(ctx context.Context, key string, value []byte) error
	Delete(ctx context.Context, key string) error
}

type HashKeyCache struct {
	mu      sync.Mutex
	storage Storage
	name    string
	key     siphash.Key
	err     error
}

// Get returns the hash key stored at name, and whether it was cached.
func (c *HashKeyCache) Get(storage Storage, name string) (siphash.Key, bool, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	// A storage of a type that cannot be compared is never cached.
	comparable := reflect.TypeOf(storage).Comparable()
	if comparable && c.storage == storage && c.name == name {
		return c.key, true, c.err
	}
	key, err := LoadHashKey(storage, name)
	if comparable {
		c.storage, c.name, c.key, c.err = storage, name, key, err
	}
	return key, false, err
}

// LoadHashKey reads the instance's hash key, or stores a new one if there
// is none (or it is unreadable: snapshots hashed with another key are
// then discarded, by their fingerprint).
func LoadHashKey(storage Storage, name string) (siphash.Key, error) {
	return call(hashKeyTimeout, func(ctx context.Context) (siphash.Key, error) {
		b, err := storage.Load(ctx, name)
		if err == nil && len(b) == 16 {
			return siphash.Key{binary.LittleEndian.Uint64(b), binary.LittleEndian.Uint64(b[8:])}, nil
		}
		if err != nil && !errors.Is(err, fs.ErrNotExist) {
			return siphash.Key{}, err
		}
		k := siphash.NewKey()
		b = binary.LittleEndian.AppendUint64(binary.LittleEndian.AppendUint64(nil, k[0]), k[1])
		return k, storage.Store(ctx, name, b)
	})
}

// call runs f with a deadline, and stops waiting for it when the deadline
// passes, even if f goes on.
func call[T any](timeout time.Duration, f func(context.Context) (T, error)) (T, error) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	type result struct {
		v   T
		err error
	}
	done := make(chan result, 1)
	go func() {
		v, err := f(ctx)
		done <- result{v, err}
	}()
	select {
	case r := <-done:
		return r.v, r.err
	case <-ctx.Done():
		var zero T
		return zero, fmt.Errorf("storage did not answer within %v", timeout)
	}
}

// fingerprint identifies a hash key in snapshots without revealing it.
func fingerprint(k siphash.Key) uint64 { return siphash.Sum(k, "rate_limit snapshot") }

// snapshotName is the storage key of a table's snapshot, in dir. The
// zone's name is escaped (see storageName), so that whatever it holds,
// the snapshot stays one file in this instance's folder.
func (id TableID) snapshotName() string {
	if id.quota != "" {
		return fmt.Sprintf("quotas/%s.%s", storageName(id.name), strings.ReplaceAll(id.quota, "/", "-"))
	}
	return fmt.Sprintf("buckets/%s.%d.%d", storageName(id.name), id.burst, int64(id.tokenTime))
}

// storageName is a zone name as one path segment of a storage key: '%',
// the separators '/' and '\', the characters Windows refuses in file
// names (<>:"|?*) and control bytes are percent-encoded as %XX. A name
// without them, as most are, is unchanged, so its snapshots keep their
// names; distinct names stay distinct.
func storageName(name string) string {
	const unsafe = "%/\\<>:\"|?*\x7f"
	clean := true
	for i := 0; i < len(name) && clean; i++ {
		clean = name[i] >= 0x20 && strings.IndexByte(unsafe, name[i]) < 0
	}
	if clean {
		return name
	}
	const hex = "0123456789ABCDEF"
	b := make([]byte, 0, len(name)+8)
	for i := 0; i < len(name); i++ {
		if c := name[i]; c < 0x20 || strings.IndexByte(unsafe, c) >= 0 {
			b = append(b, '%', hex[c>>4], hex[c&15])
		} else {
			b = append(b, c)
		}
	}
	return string(b)
}

// entrySize is the size of one of the table's snapshot entries of a
// version: a quota's counter has its count after its window's end, a
// bucket of a zone whose limit comes with each request the whole-bucket
// time of the limit that wrote it.
func (id TableID) entrySize(version uint32) int {
	if id.quota != "" || id.burst == 0 && version >= 2 {
		return snapshotEntry + 8
	}
	return snapshotEntry
}

// persistence is what a persisted table keeps for it.
type persistence struct {
	shape TableID
	// most is the longest a loaded bucket may owe: a whole bucket and
	// its zone's ban or delay (0: its shape's whole bucket).
	most  time.Duration
	name  string                    // shape.snapshotName()
	to    atomic.Pointer[Snapshots] // where to write; nil: no longer persisted
	ready chan struct{}             // closed when loading has ended
	done  chan struct{}             // closed when the writing loop has ended
	busy  atomic.Bool               // a write is in flight
	fails atomic.Bool               // the last write failed (logged once)
	wrote atomic.Bool               // a write succeeded: close may delete the snapshot
}

// Persist makes t a persisted table: it loads t's snapshot in the
// background and writes it every interval until t is destroyed. t must
// be new: its keys are hashed with sn's hash key from now on.
func (t *Table[E]) Persist(sn *Snapshots, shape TableID, most time.Duration) {
	t.key = sn.Key
	p := &persistence{shape: shape, most: most, name: shape.snapshotName(), ready: make(chan struct{}), done: make(chan struct{})}
	p.to.Store(sn)
	t.p = p
	go t.load(sn)
	go t.persistLoop()
}

// Loaded is closed once the table's snapshot has been loaded (or could
// not be); nil for a table that is not persisted.
func (t *Table[E]) Loaded() <-chan struct{} {
	if t.p == nil {
		return nil
	}
	return t.p.ready
}

// Rebind points a persisted table at the snapshots of the config that
// now uses it (nil when that config turns persistence off). A table
// hashed with another key (another storage) stops being persisted: its
// snapshot could not be read back.
func (t *Table[E]) Rebind(sn *Snapshots) {
	if t.p == nil {
		return
	}
	if sn != nil && sn.Key != t.key {
		sn.Logger.Warn("zone's buckets are not persisted until the next start: they were hashed for another storage",
			zap.String("zone", t.p.shape.name))
		sn = nil
	}
	t.p.to.Store(sn)
}

// load merges the table's snapshot into it. It ends within loadTimeout.
func (t *Table[E]) load(sn *Snapshots) {
	defer close(t.p.ready)
	name := sn.Dir + "/" + t.p.name
	log := sn.Logger.With(zap.String("zone", t.p.shape.name), zap.String("storage_key", name))
	b, err := call(loadTimeout, func(ctx context.Context) ([]byte, error) { return sn.Storage.Load(ctx, name) })
	if errors.Is(err, fs.ErrNotExist) {
		return
	}
	if err != nil {
		log.Error("cannot load buckets: they start full", zap.Error(err))
		return
	}
	kept, err := t.merge(b, fingerprint(sn.Key), time.Now())
	if err != nil {
		log.Warn("snapshot discarded", zap.Error(err))
		return
	}
	log.Info("buckets loaded", zap.Int("buckets", kept))
}

// persistLoop writes the table every interval, once it has been loaded.
func (t *Table[E]) persistLoop() {
	defer close(t.p.done)
	select {
	case <-t.p.ready:
	case <-t.stop:
		return
	}
	for {
		every := DefaultPersistInterval
		if sn := t.p.to.Load(); sn != nil {
			every = sn.Interval
		}
		timer := time.NewTimer(every)
		select {
		case <-t.stop:
			timer.Stop()
			return
		case <-timer.C:
		}
		if sn := t.p.to.Load(); sn != nil {
			_ = t.save(sn)
		}
	}
}

// closePersisted stops persisting the table t when no config uses it
// any more. When
// Caddy exits, it writes the table; when a reload dropped it (its zone
// is gone or has another rate or burst), it deletes the snapshot it
// wrote, as the buckets are gone. A config that never ran for a whole
// interval (`caddy validate`, a start or a reload that failed) writes
// and deletes nothing: the snapshot may be another process's.
func closePersisted[E Entry](t *Table[E], exiting bool) {
	if t.p == nil {
		return
	}
	<-t.p.done // after a write in flight, which ends within saveTimeout
	sn := t.p.to.Load()
	if sn == nil {
		return
	}
	select {
	case <-t.p.ready:
	default:
		return // the snapshot is still loading: writing now would lose it
	}
	if exiting {
		_ = t.save(sn)
		return
	}
	if !t.p.wrote.Load() {
		return
	}
	name := sn.Dir + "/" + t.p.name
	if _, err := call(saveTimeout, func(ctx context.Context) (struct{}, error) {
		return struct{}{}, sn.Storage.Delete(ctx, name)
	}); err != nil {
		sn.Logger.Warn("cannot delete the snapshot of a zone that is gone", zap.String("storage_key", name), zap.Error(err))
	}
}

// save writes the table's snapshot. Failures are logged when they start
// and when they end, not at every interval.
func (t *Table[E]) save(sn *Snapshots) error {
	p := t.p
	if !p.busy.CompareAndSwap(false, true) {
		return errors.New("the last write has not ended") // a storage that hangs
	}
	b := t.snapshot(time.Now(), fingerprint(sn.Key))
	name := sn.Dir + "/" + p.name
	_, err := call(saveTimeout, func(ctx context.Context) (struct{}, error) {
		defer p.busy.Store(false)
		return struct{}{}, sn.Storage.Store(ctx, name, b)
	})
	if err == nil {
		p.wrote.Store(true)
	}
	switch {
	case err != nil && !p.fails.Swap(true):
		sn.Logger.Error("cannot save buckets", zap.String("storage_key", name), zap.Error(err))
	case err == nil && p.fails.Swap(false):
		sn.Logger.Info("buckets saved again", zap.String("storage_key", name))
	}
	return err
}

// snapshot encodes the entries that are not spent at now. Each shard is
// locked only while its entries are copied, which for a million of them
// in 64 shards is a fraction of a millisecond each.
func (t *Table[E]) snapshot(now time.Time, fingerprint uint64) []byte {
	n, wall := t.Instant(now), now.UnixNano()
	size := t.size()
	entry := t.p.shape.entrySize(snapshotVersion)
	b := make([]byte, snapshotHeader, snapshotHeader+entry*(size+size/8))
	for i := range t.shards {
		s := &t.shards[i]
		s.mu.Lock()
		b = s.appendTo(b, n, wall, t.p.shape.burst == 0)
		s.mu.Unlock()
	}
	copy(b, snapshotMagic)
	binary.LittleEndian.PutUint32(b[4:], snapshotVersion)
	binary.LittleEndian.PutUint64(b[8:], fingerprint)
	binary.LittleEndian.PutUint64(b[16:], uint64(t.p.shape.tokenTime))
	binary.LittleEndian.PutUint64(b[24:], uint64(t.p.shape.burst))
	binary.LittleEndian.PutUint64(b[32:], uint64(wall))
	binary.LittleEndian.PutUint64(b[40:], uint64((len(b)-snapshotHeader)/entry))
	if _, ok := any(t).(*Table[Bucket]); ok {
		b = appendOverrides(b, t, n, wall)
	}
	return b
}

// appendOverrides appends the table's overrides at n (wall on the wall
// clock): their number, then each. One that has ended is written while
// its bucket is not full: the bucket was written under it, and is carried
// back after the restart as it would have been without one (see
// endOverride).
func appendOverrides[E Entry](b []byte, t *Table[E], n time.Duration, wall int64) []byte {
	at := len(b)
	b = binary.LittleEndian.AppendUint64(b, 0)
	count := uint64(0)
	for i := range t.shards {
		s := &t.shards[i]
		s.mu.Lock()
		for h, e := range s.ov {
			if !e.ended(n) || !s.m[h].Spent(n) {
				b = appendOverride(b, e, n, wall)
				count++
			}
		}
		s.mu.Unlock()
	}
	binary.LittleEndian.PutUint64(b[at:], count)
	return b
}

func appendOverride(b []byte, e localOverride, n time.Duration, wall int64) []byte {
	var end int64
	if e.at != 0 {
		end = wall + int64(e.at-n)
	}
	for _, v := range [3]int64{int64(e.o.TokenTime), e.o.Burst, end} {
		b = binary.LittleEndian.AppendUint64(b, uint64(v))
	}
	b = binary.LittleEndian.AppendUint16(b, uint16(len(e.o.Rate)))
	b = append(b, e.o.Rate...)
	kind, key := byte(0), e.key.Text
	if e.key.Net.IsValid() {
		kind, key = 1, e.key.Net.String()
	}
	b = append(b, kind)
	b = binary.LittleEndian.AppendUint32(b, uint32(len(key)))
	return append(b, key...)
}

// mergeOverrides adds a snapshot's overrides (b, from their number on) to
// the table, but those of keys that have one already. One that has ended
// (before the snapshot or since) comes back ended: its bucket, saved
// under it, is carried back to the zone's limit as if Caddy had run on.
func mergeOverrides(t *Table[Bucket], b []byte, n time.Duration, wall int64) error {
	errTruncated := errors.New("truncated overrides")
	if len(b) < overridesHeader {
		return errTruncated
	}
	count, b := binary.LittleEndian.Uint64(b), b[overridesHeader:]
	for range count {
		if len(b) < 26 {
			return errTruncated
		}
		token, burst, end := int64(binary.LittleEndian.Uint64(b)), int64(binary.LittleEndian.Uint64(b[8:])), int64(binary.LittleEndian.Uint64(b[16:]))
		rl := int(binary.LittleEndian.Uint16(b[24:]))
		if b = b[26:]; len(b) < rl+5 {
			return errTruncated
		}
		rate, kind, kl := string(b[:rl]), b[rl], int(binary.LittleEndian.Uint32(b[rl+1:]))
		if b = b[rl+5:]; len(b) < kl {
			return errTruncated
		}
		text := string(b[:kl])
		b = b[kl:]
		e := localOverride{key: store.Key{Text: text}, o: store.Override{TokenTime: time.Duration(token), Burst: burst, Rate: rate}}
		if kind == 1 {
			p, err := netip.ParsePrefix(text)
			if err != nil {
				return fmt.Errorf("override of %q: %v", text, err)
			}
			e.key = store.Key{Net: p}
		}
		if end != 0 {
			// An instant of the table's own time line, maybe before its
			// epoch; 0 would read as no end.
			e.o.Expires, e.at = time.Unix(0, end), n+time.Duration(end-wall)
			if e.at == 0 {
				e.at = -1
			}
		}
		addOverride(t, e)
	}
	return nil
}

// addOverride puts a loaded override in the table, if its key has none.
func addOverride(t *Table[Bucket], e localOverride) {
	h := t.Hash(e.key)
	s := t.shard(h)
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.ov[h]; ok {
		return
	}
	if s.ov == nil {
		s.ov = make(map[uint64]localOverride)
	}
	s.ov[h] = e
	t.overrides.Add(1)
}

// appendTo appends the shard's entries that are not spent at n (wall on
// the wall clock) to a snapshot. Requires s.mu to be held.
func (s *shard[E]) appendTo(b []byte, n time.Duration, wall int64, plan bool) []byte {
	for h, e := range s.m {
		if !e.Spent(n) {
			b = appendEntry(b, h, e, n, wall, plan)
		}
	}
	return b
}

// appendEntry appends an entry of hash h to a snapshot written at table
// instant n (wall on the wall clock): a bucket as the wall-clock instant
// it is full again, a counter as the one its window ends and its count.
func appendEntry[E Entry](b []byte, h uint64, e E, n time.Duration, wall int64, plan bool) []byte {
	b = binary.LittleEndian.AppendUint64(b, h)
	switch e := any(e).(type) {
	case Bucket:
		b = binary.LittleEndian.AppendUint64(b, uint64(wall+int64(e.FullAt-n)))
		if plan {
			b = binary.LittleEndian.AppendUint64(b, uint64(e.Full))
		}
	case Counter:
		b = binary.LittleEndian.AppendUint64(b, uint64(wall+int64(e.EndAt-n)))
		b = binary.LittleEndian.AppendUint64(b, uint64(e.Used))
	}
	return b
}

// mergeChunk is how many buckets merge takes a shard's lock for at most.
const mergeChunk = 1024

// merge adds the buckets of a snapshot to the table, as of now: those
// that have refilled since are dropped; a bucket the table already has
// keeps the later of its two instants (the emptier bucket); none owes
// more than its zone lets a bucket owe, a whole bucket and a ban or a
// delay (so a snapshot from a clock far ahead cannot lock anyone out for
// longer, and a ban outlives a restart as it outlives a reload). Loaded buckets only fill free
// room: they evict none. It returns how many buckets it kept.
func (t *Table[E]) merge(b []byte, fingerprint uint64, now time.Time) (int, error) {
	if len(b) < snapshotHeader || string(b[:4]) != snapshotMagic {
		return 0, errors.New("not a snapshot")
	}
	version := binary.LittleEndian.Uint32(b[4:])
	if version < 1 || version > snapshotVersion {
		return 0, fmt.Errorf("snapshot version %d, want %d", version, snapshotVersion)
	}
	if binary.LittleEndian.Uint64(b[8:]) != fingerprint {
		return 0, errors.New("hashed with another key")
	}
	tokenTime := time.Duration(binary.LittleEndian.Uint64(b[16:]))
	burst := int64(binary.LittleEndian.Uint64(b[24:]))
	if tokenTime != t.p.shape.tokenTime || burst != t.p.shape.burst {
		return 0, fmt.Errorf("zone's rate or burst changed")
	}
	count := binary.LittleEndian.Uint64(b[40:])
	entries := b[snapshotHeader:]
	entry := t.p.shape.entrySize(version)
	size := count * uint64(entry)
	if uint64(len(entries)) < size || version < 3 && uint64(len(entries)) != size {
		return 0, fmt.Errorf("%d bytes of buckets, want %d: truncated", len(entries), size)
	}
	entries, overrides := entries[:size], entries[size:]
	n, wall := t.Instant(now), now.UnixNano()
	switch t := any(t).(type) {
	case *Table[Counter]:
		return mergeCounts(t, entries, n, wall), nil
	case *Table[Bucket]:
		if version >= 3 {
			// Before the buckets, which were saved under them.
			if err := mergeOverrides(t, overrides, n, wall); err != nil {
				return 0, err
			}
		}
		kept := mergeBuckets(t, entries, entry, n, wall)
		dropEnded(t, n)
		return kept, nil
	}
	return 0, nil
}

// dropEnded removes the overrides that have ended and whose bucket is
// full: there is nothing left to carry back.
func dropEnded(t *Table[Bucket], n time.Duration) {
	for i := range t.shards {
		s := &t.shards[i]
		s.mu.Lock()
		for h, e := range s.ov {
			if e.ended(n) && s.m[h].Spent(n) {
				delete(s.ov, h)
				t.overrides.Add(-1)
			}
		}
		s.mu.Unlock()
	}
}

// mergeBuckets adds a snapshot's buckets to the table, as merge says.
func mergeBuckets(t *Table[Bucket], entries []byte, entry int, n time.Duration, wall int64) int {
	burst, tokenTime := t.p.shape.burst, t.p.shape.tokenTime
	most := n + max(time.Duration(burst)*tokenTime, t.p.most)
	if burst == 0 {
		// A zone whose limit depends on the request (plans): each
		// take clamps its bucket to the request's own burst.
		most = n + gcra.MaxBurstTime
	}
	capacity := t.shardCap()
	kept := 0
	var locked *shard[Bucket]
	for i := 0; len(entries) > 0; i, entries = i+1, entries[entry:] {
		h := binary.LittleEndian.Uint64(entries)
		fullAt := n + time.Duration(int64(binary.LittleEndian.Uint64(entries[8:]))-wall)
		full := time.Duration(tokenTime) * time.Duration(burst) // a fixed limit's
		if entry > snapshotEntry {
			full = time.Duration(binary.LittleEndian.Uint64(entries[16:]))
		}
		if fullAt <= n {
			continue // refilled
		}
		if s := t.shard(h); s != locked || i%mergeChunk == 0 {
			if locked != nil {
				locked.mu.Unlock()
			}
			locked = s
			s.mu.Lock()
		}
		if e, ok := locked.ov[h]; ok && burst != 0 {
			// A key with its own limit: its bucket was saved under it.
			own := e.o.Limit(t.base)
			full, fullAt = own.BurstTime, min(fullAt, most+own.BurstTime-full)
		} else {
			fullAt = min(fullAt, most)
		}
		if bk, ok := locked.m[h]; ok {
			if fullAt > bk.FullAt {
				locked.m[h] = Bucket{fullAt, bk.UsedAt, full}
			}
		} else if len(locked.m) < capacity {
			locked.m[h] = Bucket{fullAt, n, full}
		} else {
			continue
		}
		kept++
	}
	if locked != nil {
		locked.mu.Unlock()
	}
	return kept
}

// mergeCounts adds a snapshot's quota counters to the table: those of
// windows that have ended are dropped; a counter the table has already,
// counted since the start, gets the snapshot's count added (they count
// different requests of one window). Loaded counters only fill free
// room. It returns how many it kept.
func mergeCounts(t *Table[Counter], entries []byte, n time.Duration, wall int64) int {
	capacity := t.shardCap()
	kept := 0
	for ; len(entries) > 0; entries = entries[snapshotEntry+8:] {
		h := binary.LittleEndian.Uint64(entries)
		endAt := n + time.Duration(int64(binary.LittleEndian.Uint64(entries[8:]))-wall)
		used := int64(binary.LittleEndian.Uint64(entries[16:]))
		if endAt <= n || used <= 0 {
			continue // its window has ended
		}
		s := t.shard(h)
		s.mu.Lock()
		if c, ok := s.m[h]; ok && !c.Spent(n) {
			s.m[h] = Counter{c.EndAt, c.Used + used}
			kept++
		} else if ok || len(s.m) < capacity {
			s.m[h] = Counter{endAt, used}
			kept++
		}
		s.mu.Unlock()
	}
	return kept
}
