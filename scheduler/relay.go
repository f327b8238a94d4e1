package scheduler

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvgate/kvgate/store"
)

// outboxStore is what the relay needs of the store.
type outboxStore interface {
	Unpublished(ctx context.Context, limit int) ([]store.Event, error)
	MarkPublished(ctx context.Context, ids []string, at time.Time) error
	FeedUnpublished(ctx context.Context, limit int) (int, error)
}

// publisher is what the relay needs of JetStream.
type publisher interface {
	PublishMsgAsync(m *nats.Msg, opts ...jetstream.PublishOpt) (jetstream.PubAckFuture, error)
}

// RelayConfig tunes the relay.
type RelayConfig struct {
	Batch      int           // events read and published at once [256]
	Poll       time.Duration // store scan period when nothing wakes it [200ms]
	AckTimeout time.Duration // longest wait for a batch's acks [5s]
	Logger     *slog.Logger
	Now        func() time.Time
	// Announce, when set, is called after a batch is marked published,
	// with the tenants whose events it held (each once): the wiring uses
	// it to tell every replica that their feeds moved.
	Announce func(tenants []string)
}

// Relay moves committed outbox events to JetStream: it reads a bounded
// batch, publishes each with Nats-Msg-Id set to the event id, waits for
// the acks, and only then marks the acknowledged events published. A
// relay that dies between publish and mark publishes the batch again on
// its next start, and JetStream drops the copies within its duplicate
// window; several relays (one per replica) are safe for the same reason.
// Marking covers the longest acknowledged prefix of a batch, so the feed
// keeps the outbox's order.
//
// While its batches fail (the broker away, or its stream without a
// leader), the relay also places the committed events in the feed without
// publishing them (store.FeedUnpublished), every Poll: the event streams
// read the feed, and go on showing each state. Once the broker takes
// them, the events keep those places.
type Relay struct {
	st   outboxStore
	js   publisher
	cfg  RelayConfig
	log  *slog.Logger
	wake chan struct{}
	m    *relayMetrics
	away atomic.Bool // the last batch failed
}

// DefaultAckTimeout is how long a publish waits for the broker's ack, in
// the relay and in the client's own books (NewJetStream).
const DefaultAckTimeout = 5 * time.Second

// NewJetStream is the JetStream client the relay publishes through. An
// asynchronous publish whose ack never comes (a stream leader lost while
// the connection stays up) is dropped from the client's pending acks
// after ackTimeout, as the relay gives up on it: kept, such publishes
// fill the client's window of 4,000 in a few incidents, and every later
// publish stalls until the connection drops.
func NewJetStream(nc *nats.Conn, ackTimeout time.Duration) (jetstream.JetStream, error) {
	return jetstream.New(nc, jetstream.WithPublishAsyncTimeout(cmp.Or(ackTimeout, DefaultAckTimeout)))
}

// NewRelay returns a relay; Run starts it.
func NewRelay(st outboxStore, js publisher, cfg RelayConfig) *Relay {
	cfg.Batch = cmp.Or(cfg.Batch, 256)
	cfg.Poll = cmp.Or(cfg.Poll, 200*time.Millisecond)
	cfg.AckTimeout = cmp.Or(cfg.AckTimeout, DefaultAckTimeout)
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Relay{st: st, js: js, cfg: cfg, log: log.With("component", "relay"),
		wake: make(chan struct{}, 1), m: newRelayMetrics()}
}

// Wake asks the relay to look at the outbox now (new events were
// committed). It never blocks.
func (r *Relay) Wake() {
	select {
	case r.wake <- struct{}{}:
	default:
	}
}

// Collectors returns the relay's metrics.
func (r *Relay) Collectors() []prometheus.Collector { return r.m.collectors() }

// Run relays until ctx ends, and returns ctx's error. Store and broker
// errors are logged and retried with backoff; they never stop it.
func (r *Relay) Run(ctx context.Context) error {
	placing := make(chan struct{})
	defer func() { <-placing }()
	go func() {
		defer close(placing)
		r.placeWhileAway(ctx)
	}()
	failures := 0
	for {
		n, err := r.Once(ctx)
		r.away.Store(err != nil)
		switch {
		case ctx.Err() != nil:
			return ctx.Err()
		case err != nil:
			failures++
			r.m.errors.Inc()
			wait := retryWait(failures)
			r.log.Warn("relay batch failed", "err", err, "retry_in", wait)
			if !sleepCtx(ctx, wait) {
				return ctx.Err()
			}
			continue
		}
		failures = 0
		if n == r.cfg.Batch {
			continue // more are waiting
		}
		t := time.NewTimer(r.cfg.Poll)
		select {
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		case <-r.wake:
		case <-t.C:
		}
		t.Stop()
	}
}

// placeWhileAway places the unpublished events in the feed every Poll
// while the relay's batches fail, until ctx ends.
func (r *Relay) placeWhileAway(ctx context.Context) {
	t := time.NewTicker(r.cfg.Poll)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if !r.away.Load() {
			continue
		}
		for ctx.Err() == nil {
			fctx, cancel := context.WithTimeout(ctx, signalStoreWait)
			n, err := r.st.FeedUnpublished(fctx, r.cfg.Batch)
			cancel()
			if err != nil {
				r.log.Debug("placing unpublished events in the feed", "err", err)
				break
			}
			r.m.placed.Add(float64(n))
			if n < r.cfg.Batch {
				break
			}
		}
	}
}

// Once relays one batch and returns how many events it marked published.
// An error leaves the rest of the batch for the next call.
func (r *Relay) Once(ctx context.Context) (int, error) {
	uctx, cancel := context.WithTimeout(ctx, signalStoreWait)
	evs, err := r.st.Unpublished(uctx, r.cfg.Batch)
	cancel()
	if err != nil || len(evs) == 0 {
		return 0, err
	}
	futures := make([]jetstream.PubAckFuture, 0, len(evs))
	var pubErr error
	for _, e := range evs {
		m, err := eventMsg(e)
		if err != nil {
			pubErr = fmt.Errorf("encode event %s: %w", e.ID, err)
			break
		}
		f, err := r.js.PublishMsgAsync(m, jetstream.WithMsgID(e.ID))
		if err != nil {
			pubErr = fmt.Errorf("publish event %s: %w", e.ID, err)
			break
		}
		futures = append(futures, f)
	}
	// Wait for every ack sent; mark the acknowledged prefix.
	timeout := time.NewTimer(r.cfg.AckTimeout)
	defer timeout.Stop()
	acked := 0
	dups := 0
wait:
	for i, f := range futures {
		select {
		case ack := <-f.Ok():
			if acked == i {
				acked++
				if ack.Duplicate {
					dups++
				}
			}
		case err := <-f.Err():
			pubErr = cmp.Or(pubErr, fmt.Errorf("publish event %s: %w", evs[i].ID, err))
		case <-timeout.C:
			pubErr = cmp.Or(pubErr, fmt.Errorf("publish: no ack within %s", r.cfg.AckTimeout))
			break wait
		case <-ctx.Done():
			pubErr = cmp.Or(pubErr, ctx.Err())
			break wait // still record what was acknowledged
		}
	}
	if acked > 0 {
		ids := make([]string, acked)
		for i := range acked {
			ids[i] = evs[i].ID
		}
		// The publish is done; record it even if ctx ends now, or the
		// next relay publishes it again for nothing.
		mctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), signalStoreWait)
		err := r.st.MarkPublished(mctx, ids, r.cfg.Now())
		cancel()
		if err != nil {
			return 0, errors.Join(pubErr, fmt.Errorf("mark %d events published: %w", acked, err))
		}
		tracePublished(evs[:acked], r.cfg.Now())
		r.m.published.Add(float64(acked))
		r.m.duplicates.Add(float64(dups))
		if r.cfg.Announce != nil {
			var tenants []string
			for _, e := range evs[:acked] {
				if !slices.Contains(tenants, e.Tenant) {
					tenants = append(tenants, e.Tenant)
				}
			}
			r.cfg.Announce(tenants)
		}
	}
	return acked, pubErr
}

// retryWait is the pause after consecutive failures of a signal loop:
// 100ms doubling to 5s, so that a broker or database outage costs a probe
// every few seconds and its end is noticed soon.
func retryWait(failures int) time.Duration {
	return min(5*time.Second, 100*time.Millisecond<<min(failures-1, 6))
}

// sleepCtx waits d or until ctx ends; false if ctx ended.
func sleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

type relayMetrics struct {
	published, duplicates, errors, placed prometheus.Counter
}

func newRelayMetrics() *relayMetrics {
	return &relayMetrics{
		published: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvgate_scheduler_relay_published_total",
			Help: "Outbox events published to JetStream and marked published."}),
		duplicates: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvgate_scheduler_relay_duplicates_total",
			Help: "Publishes JetStream acknowledged as duplicates (another relay, or a retry after a crash, published the event first)."}),
		errors: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvgate_scheduler_relay_errors_total",
			Help: "Relay batches that failed on the store or the broker and were retried."}),
		placed: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvgate_scheduler_relay_placed_total",
			Help: "Outbox events placed in the feed, for the event streams, while the relay's batches failed (published later)."}),
	}
}

func (m *relayMetrics) collectors() []prometheus.Collector {
	return []prometheus.Collector{m.published, m.duplicates, m.errors, m.placed}
}
