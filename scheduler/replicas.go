package scheduler

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
)

// Several replicas, one fleet.
//
// Every replica admits against what the backends last reported plus its
// own ledger. What another replica admitted since the last scrape is in
// neither, and neither is how the other replicas' requests will grow: two
// replicas each filling a backend to its target would fill it twice. So
// each replica keeps its own flights within a share of every backend's
// KV budget and sequences, 1/n with n live replicas; the shares sum to at
// most the whole, and admission still checks the whole against the
// measurement as before.
//
// Replicas find each other in a JetStream key-value bucket: each writes
// its key every Interval, and a key not renewed for TTL expires. A
// replica that joins beside others admits nothing for two intervals, so
// that they have shrunk to their new share before it takes its own; one
// that leaves deletes its key, and the others grow once three listings in
// a row have counted fewer (a listing can miss a key being renewed).
// The slack is bounded: a replica that dies without deleting its key
// keeps its share idle until TTL passes (capacity unused, never
// overfilled), and requests admitted under a larger share finish as they
// are (a smaller share holds back new ones only). While the bucket cannot
// be read, a replica keeps the share it has; if its key expires meanwhile,
// the others grow into its share, so during such a partition the shares
// can sum to more than the whole, by at most this replica's share. When it
// renews again it joins anew, with the grace. A replica with nothing in
// flight on a backend may always send it one request (admission.go): one
// request per replica and backend of slack.
//
// Equal shares suit replicas behind one load balancer, whose traffic is
// alike; a replica with less traffic leaves part of its share idle.

// MembershipBucket is the key-value bucket of live replicas.
const MembershipBucket = "kvgate_replicas"

// MembershipConfig tunes membership.
type MembershipConfig struct {
	ID       string        // this replica's key; unique per process
	Interval time.Duration // how often to renew and recount [1s]
	TTL      time.Duration // how long an unrenewed key lives [5s]
	Logger   *slog.Logger
}

// Membership keeps this replica in the bucket and the scheduler's share
// at 1/live replicas.
type Membership struct {
	kv    jetstream.KeyValue
	sched *Scheduler
	cfg   MembershipConfig
	log   *slog.Logger
	live  prometheus.Gauge

	// Guarded by being used from Run's goroutine only.
	joined  time.Time // when this replica (re)joined: the grace counts from it
	renewed time.Time // the last successful renewal
	count   int       // the live replicas the share is computed from
	lower   int       // listings in a row that counted fewer
}

// shrinkAfter is how many listings in a row must count fewer replicas
// before the share grows.
const shrinkAfter = 3

// NewMembership creates (or opens) the bucket and returns the membership;
// Run keeps it.
func NewMembership(ctx context.Context, js jetstream.JetStream, sched *Scheduler, cfg MembershipConfig) (*Membership, error) {
	if cfg.ID == "" {
		return nil, errors.New("membership: a replica id is required")
	}
	cfg.Interval = cmp.Or(cfg.Interval, time.Second)
	cfg.TTL = cmp.Or(cfg.TTL, 5*time.Second)
	kv, err := js.CreateOrUpdateKeyValue(ctx, membershipBucket(cfg.TTL))
	if err != nil {
		return nil, fmt.Errorf("membership bucket: %w", err)
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	// Nothing beyond one request per backend until the first count.
	sched.SetShare(0)
	return &Membership{kv: kv, sched: sched, cfg: cfg, log: log.With("component", "membership", "replica", cfg.ID),
		live: prometheus.NewGauge(prometheus.GaugeOpts{Name: "kvgate_scheduler_replicas",
			Help: "Live kvgate replicas sharing the fleet, as this replica last counted them."})}, nil
}

// membershipBucket is the key-value bucket of the live replicas, each key
// living ttl unless refreshed.
func membershipBucket(ttl time.Duration) jetstream.KeyValueConfig {
	return jetstream.KeyValueConfig{Bucket: MembershipBucket, Description: "live kvgate replicas", TTL: ttl,
		History: 1, Storage: jetstream.MemoryStorage}
}

// Collectors returns the membership's metrics.
func (m *Membership) Collectors() []prometheus.Collector { return []prometheus.Collector{m.live} }

// Run renews this replica's key and recounts until ctx ends, then deletes
// the key so that the others grow at once. It returns ctx's error.
func (m *Membership) Run(ctx context.Context) error {
	t := time.NewTicker(m.cfg.Interval)
	defer t.Stop()
	for {
		m.refresh(ctx, time.Now())
		select {
		case <-ctx.Done():
			dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
			_ = m.kv.Delete(dctx, m.cfg.ID)
			cancel()
			return ctx.Err()
		case <-t.C:
		}
	}
}

func (m *Membership) refresh(ctx context.Context, now time.Time) {
	if _, err := m.kv.Put(ctx, m.cfg.ID, []byte(now.UTC().Format(time.RFC3339Nano))); err != nil {
		if ctx.Err() == nil {
			m.log.Warn("membership renewal failed; keeping the current share", "err", err)
		}
		return
	}
	// First renewal, or the first after our key may have expired (the
	// others may have grown into our share meanwhile): join anew, with
	// the grace.
	if m.renewed.IsZero() || now.Sub(m.renewed) > m.cfg.TTL {
		m.joined = now
	}
	m.renewed = now
	keys, err := m.kv.Keys(ctx)
	if err != nil && !errors.Is(err, jetstream.ErrNoKeysFound) {
		if ctx.Err() == nil {
			m.log.Warn("membership count failed; keeping the current share", "err", err)
		}
		return
	}
	// A listing can miss a key that is being renewed as it runs: a count
	// that rises applies at once (this share shrinks), one that falls
	// only when seen shrinkAfter times in a row (this share grows late,
	// never early).
	n := max(len(keys), 1)
	if n >= m.count {
		m.count, m.lower = n, 0
	} else if m.lower++; m.lower >= shrinkAfter {
		m.count, m.lower = n, 0
	}
	n = m.count
	m.live.Set(float64(n))
	share := 1 / float64(n)
	if n > 1 && now.Sub(m.joined) < 2*m.cfg.Interval {
		share = 0 // the others have not shrunk yet
	}
	m.sched.SetShare(share)
}
