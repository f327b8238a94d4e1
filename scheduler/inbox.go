package scheduler

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvgate/kvgate/store"
)

// inboxStore is what the inbox needs of the store.
type inboxStore interface {
	RecordInboxBatch(ctx context.Context, recs []store.InboxRecord, now time.Time) ([]store.InboxOutcome, error)
	PruneInbox(ctx context.Context, before time.Time, limit int) (int, error)
}

// InboxConfig tunes the inbox consumer.
type InboxConfig struct {
	Batch   int           // messages fetched at once, and the most recorded in one commit [128]
	MaxWait time.Duration // longest wait of one fetch [1s]
	// Retention is how long a record is kept: longer than the stream
	// keeps a message (SignalsConfig.MaxAge), so that no redelivery can
	// outlive it [48h]. PruneEvery is how often old records go [1h].
	Retention  time.Duration
	PruneEvery time.Duration
	Logger     *slog.Logger
	Now        func() time.Time
	// Publish, when set, is used to set a quarantined message aside on
	// the QuarantineSubj subject (the wiring passes JetStream's publish).
	Publish func(ctx context.Context, m *nats.Msg) (*jetstream.PubAck, error)
	// OnEvent is called once per event, after it is recorded and acked:
	// the wiring wakes the runner with it.
	OnEvent func(Event)
}

// Event is a job event as the inbox delivers it.
type Event struct {
	ID           string
	JobID        string
	Tenant       string
	Type         string
	State        store.State
	StateVersion int64
	CreatedAt    time.Time // when the event was committed
}

// Inbox consumes the job events from JetStream through the shared durable
// consumer. Each event is recorded in the store's inbox by id and payload
// digest before it is acknowledged (the deliveries that arrived together
// in one call, one commit: see consume), so a redelivery (the consumer died
// between commit and ack, or the broker retried) is recognised and handled
// once; an id seen again with another payload is quarantined and counted,
// never acted on. An event the store cannot record now is left
// unacknowledged and comes back.
type Inbox struct {
	st   inboxStore
	cons jetstream.Consumer
	cfg  InboxConfig
	log  *slog.Logger
	m    *inboxMetrics
}

// NewInbox returns an inbox over the consumer SetupSignals made.
func NewInbox(st inboxStore, cons jetstream.Consumer, cfg InboxConfig) *Inbox {
	cfg.Batch = cmp.Or(cfg.Batch, 128)
	cfg.MaxWait = cmp.Or(cfg.MaxWait, time.Second)
	cfg.Retention = cmp.Or(cfg.Retention, 48*time.Hour)
	cfg.PruneEvery = cmp.Or(cfg.PruneEvery, time.Hour)
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Inbox{st: st, cons: cons, cfg: cfg, log: log.With("component", "inbox"), m: newInboxMetrics()}
}

// Collectors returns the inbox's metrics.
func (in *Inbox) Collectors() []prometheus.Collector { return in.m.collectors() }

// Run consumes until ctx ends and returns ctx's error. Broker and store
// errors are logged and retried with backoff.
func (in *Inbox) Run(ctx context.Context) error {
	failures := 0
	var pruned time.Time
	for ctx.Err() == nil {
		if now := in.cfg.Now(); now.Sub(pruned) >= in.cfg.PruneEvery {
			in.prune(ctx, now)
			pruned = now
		}
		batch, err := in.cons.Fetch(in.cfg.Batch, jetstream.FetchMaxWait(in.cfg.MaxWait))
		if err == nil {
			// A store that cannot record is waited for as a broker
			// that cannot deliver is, with its events handed back for
			// as long: not fetched again at once, in a tight loop of
			// failing writes, for as long as the database is away.
			stored := in.consume(ctx, batch.Messages(), retryWait(failures+1))
			if err = batch.Error(); err == nil || errors.Is(err, nats.ErrTimeout) || errors.Is(err, context.DeadlineExceeded) {
				err = cmp.Or(stored, err)
			}
		}
		if err != nil && !errors.Is(err, nats.ErrTimeout) && !errors.Is(err, context.DeadlineExceeded) && ctx.Err() == nil {
			failures++
			in.m.errors.Inc()
			wait := retryWait(failures)
			in.log.Warn("inbox failed; events left for redelivery", "err", err, "retry_in", wait)
			sleepCtx(ctx, wait)
			continue
		}
		failures = 0
	}
	return ctx.Err()
}

// prune forgets records older than the retention, in bounded batches.
func (in *Inbox) prune(ctx context.Context, now time.Time) {
	const batch = 10_000
	for ctx.Err() == nil {
		pctx, cancel := context.WithTimeout(ctx, signalStoreWait)
		n, err := in.st.PruneInbox(pctx, now.Add(-in.cfg.Retention), batch)
		cancel()
		if err != nil {
			in.log.Warn("inbox prune failed", "err", err)
			return
		}
		in.m.pruned.Add(float64(n))
		if n < batch {
			return
		}
	}
}

// consume handles a fetch's messages as they arrive: whatever has
// arrived when the inbox is ready for more is recorded together, in one
// call to the store (one commit), then acknowledged. At a low rate each
// message goes alone, at once; under load they share the commit. Once
// the store fails, the rest of the fetch is handed back untried, each
// after delay, and the store's error returned.
func (in *Inbox) consume(ctx context.Context, msgs <-chan jetstream.Msg, delay time.Duration) error {
	var pending []jetstream.Msg
	var failed error
	for msg := range msgs {
		pending = append(pending[:0], msg)
	more:
		for len(pending) < in.cfg.Batch {
			select {
			case m, ok := <-msgs:
				if !ok {
					break more
				}
				pending = append(pending, m)
			default:
				break more
			}
		}
		if failed != nil {
			naks(ctx, pending, delay)
			continue
		}
		failed = in.handle(ctx, pending, delay)
	}
	return failed
}

// naks hands messages back for redelivery after delay, or at once when
// ctx has ended (the process is stopping: another replica takes them now,
// not after the broker's AckWait).
func naks(ctx context.Context, msgs []jetstream.Msg, delay time.Duration) {
	if ctx.Err() != nil {
		delay = 0
	}
	for _, m := range msgs {
		_ = m.NakWithDelay(delay)
	}
}

// delivery is a message that parsed, with what the inbox records of it.
type delivery struct {
	msg jetstream.Msg
	ev  wireEvent
	rec store.InboxRecord
}

// handle records a batch of deliveries, then acks them. What the store
// cannot record now is handed back for redelivery after delay, and its
// error returned.
func (in *Inbox) handle(ctx context.Context, msgs []jetstream.Msg, delay time.Duration) error {
	ds := make([]delivery, 0, len(msgs))
	recs := make([]store.InboxRecord, 0, len(msgs))
	for _, msg := range msgs {
		data := msg.Data()
		var w wireEvent
		err := json.Unmarshal(data, &w)
		id := w.ID
		if h := msg.Headers().Get(jetstream.MsgIDHeader); err != nil || id == "" || h != "" && h != id {
			in.quarantine(ctx, msg, cmp.Or(id, h), "malformed event")
			continue
		}
		rec := store.InboxRecord{EventID: id, Digest: digest(data)}
		ds, recs = append(ds, delivery{msg: msg, ev: w, rec: rec}), append(recs, rec)
	}
	if len(ds) == 0 {
		return nil
	}
	rctx, cancel := context.WithTimeout(ctx, signalStoreWait)
	outs, err := in.st.RecordInboxBatch(rctx, recs, in.cfg.Now())
	cancel()
	if err == nil && len(outs) != len(ds) {
		err = fmt.Errorf("the store answered %d outcomes for %d records", len(outs), len(ds))
	}
	if err != nil {
		back := make([]jetstream.Msg, len(ds))
		for i, d := range ds {
			back[i] = d.msg
		}
		naks(ctx, back, delay)
		return fmt.Errorf("record %d events (the first %s): %w", len(ds), ds[0].rec.EventID, err)
	}
	now := in.cfg.Now()
	for i, d := range ds {
		id := d.rec.EventID
		if outs[i] == store.InboxMismatch {
			in.quarantine(ctx, d.msg, id, "event id seen before with a different payload")
			continue
		}
		// Recorded: from here a redelivery is a duplicate. An ack lost
		// now costs one more delivery, recognised as such.
		if err := d.msg.Ack(); err != nil {
			in.log.Debug("inbox ack failed", "event_id", id, "err", err)
		}
		if outs[i] == store.InboxDuplicate {
			in.m.duplicates.Inc()
			continue
		}
		in.m.recorded.Inc()
		ev := Event(d.ev)
		var stored time.Time // when the broker took the event in
		if md, err := d.msg.Metadata(); err == nil {
			stored = md.Timestamp
		}
		traceReceived(ev, stored, now)
		if in.cfg.OnEvent != nil {
			in.cfg.OnEvent(ev)
		}
	}
	return nil
}

// quarantine sets a message aside on the quarantine subject, counts it and
// terminates its delivery; if it cannot be set aside it is left for
// redelivery instead, never dropped.
func (in *Inbox) quarantine(ctx context.Context, msg jetstream.Msg, id, why string) {
	in.log.Error("event quarantined", "event_id", id, "subject", msg.Subject(), "reason", why)
	if in.cfg.Publish != nil {
		q := nats.NewMsg(QuarantineSubj + "." + subjectToken(msg.Subject()))
		for k, vs := range msg.Headers() {
			q.Header[k] = vs
		}
		// An id of its own, the same for every copy of this message (the
		// original's would be deduplicated away): a redelivery, after a
		// Term that was lost, is set aside and counted once.
		q.Header.Set(jetstream.MsgIDHeader, "quarantine-"+id+"-"+digest(msg.Data()))
		q.Header.Set("Kvgate-Original-Msg-Id", id)
		q.Header.Set("Kvgate-Quarantine-Reason", why)
		q.Data = msg.Data()
		ack, err := in.cfg.Publish(ctx, q)
		if err != nil {
			in.log.Warn("quarantine publish failed; left for redelivery", "event_id", id, "err", err)
			_ = msg.NakWithDelay(time.Second)
			return
		}
		if ack != nil && ack.Duplicate {
			_ = msg.TermWithReason(why)
			return
		}
	}
	in.m.quarantined.Inc()
	_ = msg.TermWithReason(why)
}

type inboxMetrics struct {
	recorded, duplicates, quarantined, errors, pruned prometheus.Counter
}

func newInboxMetrics() *inboxMetrics {
	return &inboxMetrics{
		recorded: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvgate_scheduler_inbox_recorded_total",
			Help: "Job events recorded in the inbox for the first time."}),
		duplicates: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvgate_scheduler_inbox_duplicates_total",
			Help: "Redelivered job events the inbox recognised and acknowledged without acting again."}),
		quarantined: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvgate_scheduler_inbox_quarantined_total",
			Help: "Events set aside: malformed, or an id seen before with a different payload."}),
		errors: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvgate_scheduler_inbox_errors_total",
			Help: "Fetches or records that failed and were retried."}),
		pruned: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvgate_scheduler_inbox_pruned_total",
			Help: "Inbox records forgotten after the retention, when no redelivery can come."}),
	}
}

func (m *inboxMetrics) collectors() []prometheus.Collector {
	return []prometheus.Collector{m.recorded, m.duplicates, m.quarantined, m.errors, m.pruned}
}
