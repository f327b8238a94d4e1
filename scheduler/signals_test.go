package scheduler

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvgate/kvgate/bench/eventually"

	"github.com/google/uuid"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/kvgate/kvgate/store"
	"github.com/kvgate/kvgate/store/postgres/pgtest"
	"github.com/kvgate/kvgate/store/sqlite"
)

// startNATS runs a real NATS server with JetStream on a loopback port,
// keeping its files in dir; port 0 picks a free one.
func startNATS(t *testing.T, dir string, port int) *server.Server {
	t.Helper()
	if port == 0 {
		port = server.RANDOM_PORT
	}
	ns, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: port, JetStream: true, StoreDir: dir,
		NoLog: true, NoSigs: true})
	if err != nil {
		t.Fatal(err)
	}
	ns.Start()
	if !ns.ReadyForConnections(10 * time.Second) {
		t.Fatal("nats server did not start")
	}
	t.Cleanup(ns.Shutdown)
	return ns
}

// connect dials the server the way kvgate does, reconnecting for ever.
func connect(t *testing.T, url string) (*nats.Conn, jetstream.JetStream) {
	t.Helper()
	nc, err := nats.Connect(url, nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := NewJetStream(nc, 0)
	if err != nil {
		t.Fatal(err)
	}
	return nc, js
}

func openSQLite(t *testing.T) store.Store {
	t.Helper()
	st, err := sqlite.Open(context.Background(), filepath.Join(t.TempDir(), "jobs.db"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := sqlite.Migrate(context.Background(), st); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	return st
}

func acceptJobs(t *testing.T, st store.Store, tenant string, n int) {
	t.Helper()
	for i := range n {
		_, _, err := st.Accept(context.Background(), store.NewJob{
			ID: uuid.Must(uuid.NewV7()).String(), EventID: uuid.Must(uuid.NewV7()).String(),
			Tenant: tenant, IdempotencyKey: uuid.NewString(), RequestHash: "h", Endpoint: "/v1/completions",
			Model: model, Body: []byte(`{}`), MaxAttempts: 3, Deadline: time.Now().Add(time.Hour), Now: time.Now(),
			TokenEstimate: i,
		})
		if err != nil {
			t.Fatal(err)
		}
	}
}

// eventLog counts the events an inbox hands on, by id.
type eventLog struct {
	mu   sync.Mutex
	seen map[string]int
}

func (l *eventLog) add(e Event) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.seen == nil {
		l.seen = map[string]int{}
	}
	l.seen[e.ID]++
}

func (l *eventLog) count() (distinct, total int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, n := range l.seen {
		distinct++
		total += n
	}
	return distinct, total
}

func runBG(t *testing.T, run func(context.Context) error) context.CancelFunc {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = run(ctx); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	return cancel
}

type signalsFixture struct {
	st    store.Store
	nc    *nats.Conn
	js    jetstream.JetStream
	cons  jetstream.Consumer
	feed  *Feed
	log   *eventLog
	inbox *Inbox
}

func startSignals(t *testing.T, st store.Store, url string) *signalsFixture {
	t.Helper()
	nc, js := connect(t, url)
	cons, err := SetupSignals(context.Background(), js, SignalsConfig{AckWait: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	f := &signalsFixture{st: st, nc: nc, js: js, cons: cons, feed: NewFeed(), log: &eventLog{}}
	f.inbox = NewInbox(st, cons, InboxConfig{MaxWait: 100 * time.Millisecond, OnEvent: f.log.add,
		Publish: func(ctx context.Context, m *nats.Msg) (*jetstream.PubAck, error) { return js.PublishMsg(ctx, m) }})
	return f
}

func (f *signalsFixture) relay() *Relay {
	return NewRelay(f.st, f.js, RelayConfig{Batch: 16, Poll: 10 * time.Millisecond, AckTimeout: time.Second,
		Announce: func(tenants []string) { _ = f.nc.Publish(FeedSubject, FeedNotice(tenants)) }})
}

func unpublished(t *testing.T, st store.Store) int {
	t.Helper()
	evs, err := st.Unpublished(context.Background(), 100_000)
	if err != nil {
		t.Fatal(err)
	}
	return len(evs)
}

// Every committed event reaches the inbox exactly once, in bounded
// batches, and the feed notice reaches a follower.
func TestRelayAndInbox(t *testing.T) {
	ns := startNATS(t, t.TempDir(), 0)
	st := openSQLite(t)
	f := startSignals(t, st, ns.ClientURL())
	changed, other := f.feed.Changed("acme"), f.feed.Changed("globex")
	runBG(t, func(ctx context.Context) error { return FollowFeed(ctx, f.nc, f.feed) })
	acceptJobs(t, st, "acme", 50)
	r := f.relay()
	runBG(t, r.Run)
	runBG(t, f.inbox.Run)
	eventually.True(t, "50 events in the inbox", func() bool { d, _ := f.log.count(); return d == 50 })
	eventually.True(t, "the outbox drained", func() bool { return unpublished(t, st) == 0 })
	select {
	case <-changed:
	case <-time.After(10 * time.Second):
		t.Error("no feed notice after publishing")
	}
	select {
	case <-other:
		t.Error("acme's events woke globex's waiters")
	default:
	}
	if _, total := f.log.count(); total != 50 {
		t.Errorf("inbox handed on %d events for 50 distinct", total)
	}
	feed, err := st.Events(context.Background(), "acme", "", 0, 1000)
	if err != nil || len(feed) != 50 {
		t.Fatalf("published feed: %d events, %v", len(feed), err)
	}
	if got := testutil.ToFloat64(r.m.published); got != 50 {
		t.Errorf("relay published %v, want 50", got)
	}
}

// crashAfterPublish is the real store with MarkPublished failing until
// allowed: the relay has published and dies before recording it.
type crashAfterPublish struct {
	store.Store
	allow atomic.Bool
	tries atomic.Int64
}

func (c *crashAfterPublish) MarkPublished(ctx context.Context, ids []string, at time.Time) error {
	c.tries.Add(1)
	if !c.allow.Load() {
		return errors.New("relay process killed before marking")
	}
	return c.Store.MarkPublished(ctx, ids, at)
}

// A relay that dies between publish and mark publishes again; JetStream
// drops the copies by Nats-Msg-Id and the inbox sees each event once.
func TestRelayDiesBetweenPublishAndMark(t *testing.T) {
	ns := startNATS(t, t.TempDir(), 0)
	st := openSQLite(t)
	acceptJobs(t, st, "acme", 20)
	crashy := &crashAfterPublish{Store: st}
	f := startSignals(t, st, ns.ClientURL())
	first := NewRelay(crashy, f.js, RelayConfig{Batch: 100})
	if _, err := first.Once(context.Background()); err == nil {
		t.Fatal("the crashing relay reported success")
	}
	if n := unpublished(t, st); n != 20 {
		t.Fatalf("%d unpublished after the crash, want all 20", n)
	}
	// A second relay (the restarted process, or another replica).
	crashy.allow.Store(true)
	second := NewRelay(crashy, f.js, RelayConfig{Batch: 100})
	if n, err := second.Once(context.Background()); err != nil || n != 20 {
		t.Fatalf("second relay: %d, %v", n, err)
	}
	if got := testutil.ToFloat64(second.m.duplicates); got != 20 {
		t.Errorf("JetStream flagged %v duplicates, want 20", got)
	}
	runBG(t, f.inbox.Run)
	eventually.True(t, "20 events in the inbox", func() bool { d, _ := f.log.count(); return d == 20 })
	info, err := f.js.Stream(context.Background(), StreamName)
	if err != nil {
		t.Fatal(err)
	}
	if msgs := info.CachedInfo().State.Msgs; msgs != 20 {
		t.Errorf("stream holds %d messages, want 20: duplicates were stored", msgs)
	}
	if _, total := f.log.count(); total != 20 {
		t.Errorf("inbox handed on %d events, want 20", total)
	}
}

// crashAfterCommit is the real store with the inbox's record committing
// and then failing once per event: the consumer died between commit and
// ack.
type crashAfterCommit struct {
	store.Store
	mu      sync.Mutex
	crashed map[string]bool
}

func (c *crashAfterCommit) RecordInboxBatch(ctx context.Context, recs []store.InboxRecord, now time.Time) ([]store.InboxOutcome, error) {
	outs, err := c.Store.RecordInboxBatch(ctx, recs, now)
	c.mu.Lock()
	defer c.mu.Unlock()
	crash := false
	for _, r := range recs {
		if err == nil && !c.crashed[r.EventID] {
			c.crashed[r.EventID], crash = true, true
		}
	}
	if crash {
		return nil, errors.New("consumer killed after commit, before ack")
	}
	return outs, err
}

// The redelivery after a consumer died between commit and ack is
// recognised as a duplicate: recorded once, acted on at most once.
func TestConsumerDiesBetweenCommitAndAck(t *testing.T) {
	ns := startNATS(t, t.TempDir(), 0)
	st := openSQLite(t)
	acceptJobs(t, st, "acme", 10)
	f := startSignals(t, st, ns.ClientURL())
	if n, err := f.relay().Once(context.Background()); err != nil || n != 10 {
		t.Fatalf("relay: %d, %v", n, err)
	}
	crashy := &crashAfterCommit{Store: st, crashed: map[string]bool{}}
	in := NewInbox(crashy, f.cons, InboxConfig{MaxWait: 100 * time.Millisecond, OnEvent: f.log.add})
	runBG(t, in.Run)
	eventually.True(t, "10 redeliveries recognised", func() bool { return testutil.ToFloat64(in.m.duplicates) == 10 })
	if d, total := f.log.count(); d != 0 || total != 0 {
		t.Errorf("events acted on after a crash before ack: %d distinct, %d in all; want none acted on twice", d, total)
	}
	eventually.True(t, "the consumer to have nothing pending", func() bool {
		ci, err := f.cons.Info(context.Background())
		return err == nil && ci.NumAckPending == 0 && ci.NumPending == 0
	})
}

// An event id that comes again with another payload is quarantined and
// counted, never acted on; the original stands.
func TestInboxQuarantinesDigestMismatch(t *testing.T) {
	ns := startNATS(t, t.TempDir(), 0)
	st := openSQLite(t)
	acceptJobs(t, st, "acme", 1)
	f := startSignals(t, st, ns.ClientURL())
	if n, err := f.relay().Once(context.Background()); err != nil || n != 1 {
		t.Fatalf("relay: %d, %v", n, err)
	}
	runBG(t, f.inbox.Run)
	eventually.True(t, "the event in the inbox", func() bool { d, _ := f.log.count(); return d == 1 })
	var id string
	f.log.mu.Lock()
	for k := range f.log.seen {
		id = k
	}
	f.log.mu.Unlock()
	// The same id, another payload, under another message id (a buggy or
	// hostile publisher).
	forged := nats.NewMsg("kvgate.events.job.succeeded")
	forged.Data = []byte(`{"id":"` + id + `","job_id":"x","tenant":"acme","type":"job.succeeded","state":"SUCCEEDED","state_version":9}`)
	if _, err := f.js.PublishMsg(context.Background(), forged); err != nil {
		t.Fatal(err)
	}
	eventually.True(t, "the forgery quarantined", func() bool { return testutil.ToFloat64(f.inbox.m.quarantined) == 1 })
	if _, total := f.log.count(); total != 1 {
		t.Errorf("events acted on: %d, want the original only", total)
	}
	q, err := f.js.Stream(context.Background(), StreamName)
	if err != nil {
		t.Fatal(err)
	}
	msg, err := q.GetLastMsgForSubject(context.Background(), QuarantineSubj+".>")
	if err != nil {
		t.Fatalf("quarantined message not kept: %v", err)
	}
	if msg.Header.Get("Kvgate-Original-Msg-Id") != id {
		t.Errorf("quarantined message headers: %v", msg.Header)
	}
	// The same forgery again (a redelivery whose Term was lost looks
	// alike): set aside and counted once.
	if _, err := f.js.PublishMsg(context.Background(), forged); err != nil {
		t.Fatal(err)
	}
	eventually.True(t, "the consumer to have nothing pending", func() bool {
		ci, err := f.cons.Info(context.Background())
		return err == nil && ci.NumAckPending == 0 && ci.NumPending == 0
	})
	info, err := q.Info(context.Background(), jetstream.WithSubjectFilter(QuarantineSubj+".>"))
	if err != nil {
		t.Fatal(err)
	}
	kept := 0
	for _, n := range info.State.Subjects {
		kept += int(n)
	}
	if got := testutil.ToFloat64(f.inbox.m.quarantined); got != 1 || kept != 1 {
		t.Errorf("the forgery twice: counted %v, %d copies kept; want 1 and 1", got, kept)
	}
}

// With the broker down, acceptance goes on (it only touches the store),
// and the events reach the feed, for the event streams, unpublished; when
// it returns, the relay drains the backlog, the events keeping their
// places, and the inbox sees every event once.
func TestNATSDownThenBacklogDrains(t *testing.T) {
	dir := t.TempDir()
	ns := startNATS(t, dir, 0)
	port := ns.Addr().(*net.TCPAddr).Port
	st := openSQLite(t)
	f := startSignals(t, st, ns.ClientURL())
	r := f.relay()
	runBG(t, r.Run)
	runBG(t, f.inbox.Run)
	acceptJobs(t, st, "acme", 10)
	eventually.True(t, "the first 10 events", func() bool { d, _ := f.log.count(); return d == 10 })

	ns.Shutdown()
	ns.WaitForShutdown()
	acceptJobs(t, st, "acme", 40) // acceptance does not need the broker
	eventually.True(t, "the relay to notice the outage", func() bool { return testutil.ToFloat64(r.m.errors) > 0 })
	feed := func() []store.Event {
		evs, err := st.Events(context.Background(), "acme", "", 0, 1000)
		if err != nil {
			t.Fatal(err)
		}
		return evs
	}
	eventually.True(t, "the outage's events in the feed", func() bool { return len(feed()) == 50 })
	during := feed()
	if n := unpublished(t, st); n != 40 {
		t.Fatalf("%d unpublished during the outage, want 40", n)
	}
	if got := testutil.ToFloat64(r.m.placed); got != 40 {
		t.Errorf("kvgate_scheduler_relay_placed_total %v, want 40", got)
	}

	startNATS(t, dir, port) // the same files, the same address
	eventually.True(t, "the backlog relayed", func() bool { return unpublished(t, st) == 0 })
	eventually.True(t, "all 50 events in the inbox", func() bool { d, _ := f.log.count(); return d == 50 })
	if _, total := f.log.count(); total != 50 {
		t.Errorf("inbox acted on %d events, want 50", total)
	}
	after := feed()
	for i := range during {
		if after[i].ID != during[i].ID || after[i].Cursor != during[i].Cursor || after[i].PublishedAt.IsZero() {
			t.Fatalf("event %d: %+v once published, was %+v in the outage: want its place kept", i, after[i], during[i])
		}
	}
}

// Several relays (one per replica) on one PostgreSQL database and one
// stream: every event is stored on the stream once, recorded by the inbox
// once, and gets one place in the feed, the places following each job's
// state order.
func TestConcurrentRelaysOnPostgres(t *testing.T) {
	ns := startNATS(t, t.TempDir(), 0)
	st := pgtest.Open(t)
	acceptJobs(t, st, "acme", 300)
	f := startSignals(t, st, ns.ClientURL())
	for range 3 {
		_, js := connect(t, ns.ClientURL())
		r := NewRelay(st, js, RelayConfig{Batch: 32, Poll: 5 * time.Millisecond})
		runBG(t, r.Run)
	}
	runBG(t, f.inbox.Run)
	eventually.True(t, "the outbox drained", func() bool { return unpublished(t, st) == 0 })
	eventually.True(t, "300 events in the inbox", func() bool { d, _ := f.log.count(); return d == 300 })
	s, err := f.js.Stream(context.Background(), StreamName)
	if err != nil {
		t.Fatal(err)
	}
	info, err := s.Info(context.Background())
	if err != nil || info.State.Msgs != 300 {
		t.Errorf("stream holds %d messages (%v), want 300", info.State.Msgs, err)
	}
	feed, err := st.Events(context.Background(), "acme", "", 0, 1000)
	if err != nil || len(feed) != 300 {
		t.Fatalf("feed: %d events, %v", len(feed), err)
	}
	for i, e := range feed {
		if e.Cursor != feed[0].Cursor+int64(i) {
			t.Fatalf("feed cursors not contiguous at %d: %d after %d", i, e.Cursor, feed[i-1].Cursor)
		}
	}
	if _, total := f.log.count(); total != 300 {
		t.Errorf("inbox acted on %d events, want 300", total)
	}
}

// The inbox forgets records older than its retention, and only those.
func TestInboxPrunesOldRecords(t *testing.T) {
	ns := startNATS(t, t.TempDir(), 0)
	st := openSQLite(t)
	now := time.Now()
	for i, age := range []time.Duration{72 * time.Hour, 50 * time.Hour, time.Hour} {
		if _, err := st.RecordInbox(context.Background(), fmt.Sprintf("old%d", i), "d", now.Add(-age)); err != nil {
			t.Fatal(err)
		}
	}
	f := startSignals(t, st, ns.ClientURL())
	in := NewInbox(st, f.cons, InboxConfig{MaxWait: 50 * time.Millisecond, Retention: 48 * time.Hour})
	runBG(t, in.Run)
	eventually.True(t, "two records pruned", func() bool { return testutil.ToFloat64(in.m.pruned) == 2 })
	if dup, err := st.RecordInbox(context.Background(), "old2", "d", now); err != nil || !dup {
		t.Errorf("a record within the retention was pruned: dup %v, %v", dup, err)
	}
}

// countingInbox counts the store calls the inbox makes to record.
type countingInbox struct {
	store.Store
	calls, records atomic.Int64
}

func (c *countingInbox) RecordInboxBatch(ctx context.Context, recs []store.InboxRecord, now time.Time) ([]store.InboxOutcome, error) {
	c.calls.Add(1)
	c.records.Add(int64(len(recs)))
	return c.Store.RecordInboxBatch(ctx, recs, now)
}

// A backlog of deliveries is recorded in batches, far fewer commits than
// events; each event is still acted on once, and a forged copy of one
// (same id, other payload) in the middle of a batch is quarantined alone,
// while the batch's other events are acknowledged.
func TestInboxRecordsBacklogInBatches(t *testing.T) {
	ns := startNATS(t, t.TempDir(), 0)
	st := pgtest.Open(t)
	acceptJobs(t, st, "acme", 300)
	f := startSignals(t, st, ns.ClientURL())
	for unpublished(t, st) > 0 {
		if _, err := f.relay().Once(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	evs, err := st.Events(context.Background(), "acme", "", 0, 1)
	if err != nil || len(evs) != 1 {
		t.Fatalf("feed: %v, %v", evs, err)
	}
	forged := nats.NewMsg("kvgate.events.job.succeeded")
	forged.Data = []byte(`{"id":"` + evs[0].ID + `","job_id":"x","tenant":"acme","type":"job.succeeded","state":"SUCCEEDED","state_version":9}`)
	if _, err := f.js.PublishMsg(context.Background(), forged); err != nil {
		t.Fatal(err)
	}
	acceptJobs(t, st, "acme", 20) // after the forgery on the stream
	for unpublished(t, st) > 0 {
		if _, err := f.relay().Once(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	counted := &countingInbox{Store: st}
	in := NewInbox(counted, f.cons, InboxConfig{MaxWait: 100 * time.Millisecond, OnEvent: f.log.add,
		Publish: func(ctx context.Context, m *nats.Msg) (*jetstream.PubAck, error) { return f.js.PublishMsg(ctx, m) }})
	runBG(t, in.Run)
	eventually.True(t, "320 events in the inbox", func() bool { d, _ := f.log.count(); return d == 320 })
	eventually.True(t, "the forgery quarantined", func() bool { return testutil.ToFloat64(in.m.quarantined) == 1 })
	eventually.True(t, "the consumer to have nothing pending", func() bool {
		ci, err := f.cons.Info(context.Background())
		return err == nil && ci.NumAckPending == 0 && ci.NumPending == 0
	})
	if _, total := f.log.count(); total != 320 {
		t.Errorf("inbox acted on %d events, want 320", total)
	}
	if got := testutil.ToFloat64(in.m.recorded); got != 320 {
		t.Errorf("recorded %v, want 320", got)
	}
	calls, records := counted.calls.Load(), counted.records.Load()
	if records != 321 || calls > records/4 {
		t.Errorf("%d records in %d store calls; want the 321 deliveries in batches", records, calls)
	}
	t.Logf("%d deliveries recorded in %d store calls", records, calls)
}

// TestRedactURLs: NATS credentials in a server URL never reach a log
// line or an error.
func TestRedactURLs(t *testing.T) {
	for in, want := range map[string]string{
		"nats://127.0.0.1:4222":                            "nats://127.0.0.1:4222",
		"nats://kvgate:s3cret@nats:4222":                   "nats://kvgate:xxxxx@nats:4222",
		"nats://s3cret@nats:4222":                          "nats://xxxxx@nats:4222",
		"nats://a:s3cret@n1:4222, nats://b:s3cret@n2:4222": "nats://a:xxxxx@n1:4222,nats://b:xxxxx@n2:4222",
		"in-process": "in-process",
	} {
		if got := redactURLs(in); got != want || strings.Contains(got, "s3cret") {
			t.Errorf("redactURLs(%q) = %q, want %q", in, got, want)
		}
	}
}

// TestBrokerLogsNoCredentials: a broker given a NATS URL with a password
// in it logs the URL with the password replaced.
func TestBrokerLogsNoCredentials(t *testing.T) {
	ns := startNATS(t, t.TempDir(), 0)
	url := strings.Replace(ns.ClientURL(), "nats://", "nats://kvgate:s3cret@", 1)
	var mu sync.Mutex
	var buf bytes.Buffer
	sched, err := New(&staticSource{}, Options{})
	if err != nil {
		t.Fatal(err)
	}
	b, err := StartBroker(openStore(t).(brokerStore), sched, BrokerConfig{
		URL: url, Logger: slog.New(slog.NewTextHandler(lockedWriter{&mu, &buf}, nil)),
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = b.Run(ctx); close(done) }()
	defer func() { cancel(); <-done }()
	logged := func() string { mu.Lock(); defer mu.Unlock(); return buf.String() }
	eventually.True(t, "the broker to log its NATS URL", func() bool { return strings.Contains(logged(), "signals over nats") })
	if out := logged(); strings.Contains(out, "s3cret") || !strings.Contains(out, "kvgate:xxxxx@") {
		t.Errorf("the broker's log shows the URL as:\n%s", out)
	}
}

// lockedWriter serialises writes to w, and reads of it under mu.
type lockedWriter struct {
	mu *sync.Mutex
	w  io.Writer
}

func (l lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}

// TestUnansweredPublishesLeaveTheClient: a publish whose ack never comes
// (here a subject that a plain subscriber takes and never answers; in
// production a stream leader lost while the connection stays up) leaves
// the client's pending acks once the relay would have given up on it.
// Kept there, a few such incidents filled the client's window, and every
// later publish stalled until the connection dropped.
func TestUnansweredPublishesLeaveTheClient(t *testing.T) {
	ns := startNATS(t, t.TempDir(), 0)
	nc, err := nats.Connect(ns.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := NewJetStream(nc, 100*time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := nc.SubscribeSync("silent.>"); err != nil {
		t.Fatal(err)
	}
	for range 50 {
		if _, err := js.PublishAsync("silent.x", []byte("x")); err != nil {
			t.Fatal(err)
		}
	}
	if n := js.PublishAsyncPending(); n == 0 {
		t.Fatal("no publish pending: the test shows nothing")
	}
	eventually.True(t, "the unanswered publishes to leave the pending acks", func() bool { return js.PublishAsyncPending() == 0 })
}

// TestKeepSignalsMakesAgainWhatTheBrokerLost: a broker that lost kvgate's
// stream, the inbox's consumer or the membership bucket (a restart without
// storage; the bucket, in memory, at any restart) has them made again,
// and the handles made before work on by name.
func TestKeepSignalsMakesAgainWhatTheBrokerLost(t *testing.T) {
	ns := startNATS(t, t.TempDir(), 0)
	_, js := connect(t, ns.ClientURL())
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	cons, err := SetupSignals(ctx, js, SignalsConfig{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := js.CreateOrUpdateKeyValue(ctx, membershipBucket(time.Second)); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		done <- KeepSignals(ctx, js, SignalsConfig{}, time.Second, 20*time.Millisecond, slog.New(slog.DiscardHandler))
	}()
	for _, lose := range []func() error{
		func() error { return js.DeleteKeyValue(ctx, MembershipBucket) },
		func() error { return js.DeleteConsumer(ctx, StreamName, InboxConsumer) },
		func() error { return js.DeleteStream(ctx, StreamName) },
	} {
		if err := lose(); err != nil {
			t.Fatal(err)
		}
		eventually.True(t, "kvgate's stream, consumer and bucket made again", func() bool {
			gone, err := signalsGone(ctx, js)
			return err == nil && gone == ""
		})
	}
	// The consumer handle from before reads an event published now.
	if _, err := js.Publish(ctx, "kvgate.events.t.j1", []byte(`{}`), jetstream.WithMsgID("ev-after-loss")); err != nil {
		t.Fatal(err)
	}
	batch, err := cons.Fetch(1, jetstream.FetchMaxWait(5*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for m := range batch.Messages() {
		n++
		_ = m.Ack()
	}
	if n != 1 {
		t.Errorf("the consumer made before the loss read %d events, want 1", n)
	}
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Errorf("KeepSignals ended with %v", err)
	}
}

// storeDown fails every inbox record while down is set.
type storeDown struct {
	countingInbox
	down atomic.Bool
}

func (s *storeDown) RecordInboxBatch(ctx context.Context, recs []store.InboxRecord, now time.Time) ([]store.InboxOutcome, error) {
	if s.down.Load() {
		s.calls.Add(1)
		return nil, fmt.Errorf("record inbox: %w", store.ErrUnavailable)
	}
	return s.countingInbox.RecordInboxBatch(ctx, recs, now)
}

// TestInboxBacksOffAStoreThatCannotRecord: with the store away and a
// backlog on the stream, the inbox waits between tries as it does for
// the broker, each longer, handing a failed fetch's events back
// untried, rather than fetching the next batch at once to fail again
// (eight batches of this backlog, every second); once the store is back,
// every event is recorded once.
func TestInboxBacksOffAStoreThatCannotRecord(t *testing.T) {
	ns := startNATS(t, t.TempDir(), 0)
	st := openSQLite(t)
	acceptJobs(t, st, "acme", 1000)
	f := startSignals(t, st, ns.ClientURL())
	for unpublished(t, st) > 0 {
		if _, err := f.relay().Once(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	down := &storeDown{countingInbox: countingInbox{Store: st}}
	down.down.Store(true)
	in := NewInbox(down, f.cons, InboxConfig{MaxWait: 100 * time.Millisecond, OnEvent: f.log.add})
	runBG(t, in.Run)
	time.Sleep(2 * time.Second) // the inbox's backoff runs on the wall clock
	calls := down.calls.Load()
	t.Logf("%d failing store calls in 2s", calls)
	if calls > 6 {
		t.Errorf("%d failing store calls in 2s, want the backoff's few (100ms, 200ms, 400ms, 800ms apart)", calls)
	}
	down.down.Store(false)
	eventually.True(t, "every event recorded once the store is back", func() bool { d, _ := f.log.count(); return d == 1000 })
	if _, total := f.log.count(); total != 1000 {
		t.Errorf("acted on %d events, want 1000", total)
	}
}

// TestFeedWakesTheTenantsNamed: a notice wakes the waiters of the tenants
// it names and those of any tenant; one that names none wakes everyone.
func TestFeedWakesTheTenantsNamed(t *testing.T) {
	f := NewFeed()
	closed := func(ch <-chan struct{}) bool {
		select {
		case <-ch:
			return true
		default:
			return false
		}
	}
	a, b, anyone := f.Changed("a"), f.Changed("b"), f.Changed("")
	f.Notify("a")
	if !closed(a) || closed(b) || !closed(anyone) {
		t.Errorf("Notify(a): a %v, b %v, any %v; want a and any woken", closed(a), closed(b), closed(anyone))
	}
	if again := f.Changed("a"); closed(again) {
		t.Error("a waiter after the notice is woken by it")
	}
	f.Notify()
	if !closed(b) {
		t.Error("a notice that names no tenant did not wake b")
	}
	var notice []string
	if err := json.Unmarshal(FeedNotice([]string{"a", "b"}), &notice); err != nil || len(notice) != 2 || FeedNotice(nil) != nil {
		t.Errorf("FeedNotice: %q %v", notice, err)
	}
}
