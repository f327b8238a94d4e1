package scheduler

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvgate/kvgate/store"
)

// Names on the broker. One stream holds the job events and the
// quarantined ones; one durable consumer, shared by every replica, feeds
// the inbox; a plain subject tells every replica that the feed moved.
const (
	StreamName     = "KVGATE_EVENTS"
	EventSubjects  = "kvgate.events.>"
	QuarantineSubj = "kvgate.quarantine"
	InboxConsumer  = "kvgate-inbox"
	FeedSubject    = "kvgate.feed"
)

// signalStoreWait bounds each call of the relay and the inbox to the
// store: one hung on a connection a crashed database host left half open
// is given up and tried again (the relay's next round, the broker's
// redelivery), rather than stalling the feed until the kernel drops it.
const signalStoreWait = 10 * time.Second

// SignalsConfig shapes the stream.
type SignalsConfig struct {
	// Replicas of the stream on a clustered server [1].
	Replicas int
	// MaxAge keeps events this long on the broker [24h].
	MaxAge time.Duration
	// Duplicates is the window in which JetStream drops a second publish
	// of the same event id [2m]: longer than a relay's retry backoff.
	Duplicates time.Duration
	// AckWait before the broker redelivers an unacknowledged event [30s].
	AckWait time.Duration
}

// SetupSignals creates (or updates) the stream and the inbox's durable
// consumer. It is safe to call from every replica on every start.
func SetupSignals(ctx context.Context, js jetstream.JetStream, cfg SignalsConfig) (jetstream.Consumer, error) {
	cfg.Replicas = max(cfg.Replicas, 1)
	if cfg.MaxAge <= 0 {
		cfg.MaxAge = 24 * time.Hour
	}
	if cfg.Duplicates <= 0 {
		cfg.Duplicates = 2 * time.Minute
	}
	if cfg.AckWait <= 0 {
		cfg.AckWait = 30 * time.Second
	}
	_, err := js.CreateOrUpdateStream(ctx, jetstream.StreamConfig{
		Name:        StreamName,
		Description: "kvgate job events, relayed from the store's outbox",
		Subjects:    []string{EventSubjects, QuarantineSubj + ".>"},
		Storage:     jetstream.FileStorage,
		Retention:   jetstream.LimitsPolicy,
		MaxAge:      cfg.MaxAge,
		Duplicates:  cfg.Duplicates,
		Replicas:    cfg.Replicas,
	})
	if err != nil {
		return nil, fmt.Errorf("create stream %s: %w", StreamName, err)
	}
	cons, err := js.CreateOrUpdateConsumer(ctx, StreamName, jetstream.ConsumerConfig{
		Durable:       InboxConsumer,
		Description:   "kvgate's inbox: every job event, recorded once",
		FilterSubject: EventSubjects,
		AckPolicy:     jetstream.AckExplicitPolicy,
		AckWait:       cfg.AckWait,
		MaxAckPending: 4096,
		DeliverPolicy: jetstream.DeliverAllPolicy,
		Replicas:      cfg.Replicas,
	})
	if err != nil {
		return nil, fmt.Errorf("create consumer %s: %w", InboxConsumer, err)
	}
	return cons, nil
}

// wireEvent is an event on the broker. Its id travels as Nats-Msg-Id too.
type wireEvent struct {
	ID           string      `json:"id"`
	JobID        string      `json:"job_id"`
	Tenant       string      `json:"tenant"`
	Type         string      `json:"type"`
	State        store.State `json:"state"`
	StateVersion int64       `json:"state_version"`
	CreatedAt    time.Time   `json:"created_at"`
}

// eventMsg renders an outbox event as a broker message.
func eventMsg(e store.Event) (*nats.Msg, error) {
	data, err := json.Marshal(wireEvent{ID: e.ID, JobID: e.JobID, Tenant: e.Tenant, Type: e.Type,
		State: e.State, StateVersion: e.StateVersion, CreatedAt: e.CreatedAt.UTC()})
	if err != nil {
		return nil, err
	}
	m := nats.NewMsg("kvgate.events." + subjectToken(e.Type))
	m.Header.Set(jetstream.MsgIDHeader, e.ID)
	m.Data = data
	return m, nil
}

// subjectToken keeps an event type usable as subject tokens: "job.succeeded"
// stays two tokens; anything a subject cannot hold becomes "_".
func subjectToken(s string) string {
	return strings.Map(func(r rune) rune {
		switch {
		case r == '.' || r == '_' || r == '-' || r >= 'a' && r <= 'z' || r >= '0' && r <= '9':
			return r
		}
		return '_'
	}, s)
}

// digest is what the inbox compares when an event id comes again.
func digest(data []byte) string {
	sum := sha256.Sum256(data)
	return hex.EncodeToString(sum[:])
}

// Feed tells waiters that new events may be in the store's published
// feed: a tenant's waiters when that tenant's events were published, so
// that an event stream reads the store for its own tenant's events, not
// for every batch any tenant's relay published. Safe for concurrent use.
type Feed struct {
	mu      sync.Mutex
	any     chan struct{}            // closed at the next notice of any tenant
	tenants map[string]chan struct{} // one tenant's waiters; gone once told
}

// NewFeed returns a feed with no waiters.
func NewFeed() *Feed { return &Feed{any: make(chan struct{}), tenants: map[string]chan struct{}{}} }

// Changed returns a channel closed at the next notice that names tenant,
// or any tenant when tenant is "".
func (f *Feed) Changed(tenant string) <-chan struct{} {
	f.mu.Lock()
	defer f.mu.Unlock()
	if tenant == "" {
		return f.any
	}
	ch, ok := f.tenants[tenant]
	if !ok {
		ch = make(chan struct{})
		f.tenants[tenant] = ch
	}
	return ch
}

// Notify wakes the waiters of the tenants named, and those of any
// tenant; with none named (a notice that does not say), every waiter.
func (f *Feed) Notify(tenants ...string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	close(f.any)
	f.any = make(chan struct{})
	if len(tenants) == 0 {
		for t, ch := range f.tenants {
			close(ch)
			delete(f.tenants, t)
		}
		return
	}
	for _, t := range tenants {
		if ch, ok := f.tenants[t]; ok {
			close(ch)
			delete(f.tenants, t)
		}
	}
}

// FeedNotice is the body of a notice on FeedSubject: the tenants whose
// events a relay batch published (a JSON array). An empty body names
// none, and wakes every waiter.
func FeedNotice(tenants []string) []byte {
	if len(tenants) == 0 {
		return nil
	}
	b, _ := json.Marshal(tenants)
	return b
}

// FollowFeed notifies feed whenever any replica's relay says the feed
// moved, until ctx ends. Those notices are plain NATS messages, lost
// freely: readers of the feed also look on a timer.
func FollowFeed(ctx context.Context, nc *nats.Conn, feed *Feed) error {
	sub, err := nc.Subscribe(FeedSubject, func(m *nats.Msg) {
		var tenants []string
		if len(m.Data) > 0 && json.Unmarshal(m.Data, &tenants) != nil {
			tenants = nil // unreadable: it wakes everyone
		}
		feed.Notify(tenants...)
	})
	if err != nil {
		return fmt.Errorf("subscribe %s: %w", FeedSubject, err)
	}
	<-ctx.Done()
	_ = sub.Unsubscribe()
	return ctx.Err()
}

// CooldownSubject carries backends' cooldowns between replicas.
const CooldownSubject = "kvgate.cooldown"

// maxCooldown bounds a cooldown received from another replica.
const maxCooldown = time.Minute

type cooldownMsg struct {
	URL   string    `json:"url"`
	Until time.Time `json:"until"`
}

// PublishCooldown tells every replica that the backend at url asked for a
// pause until until. A plain NATS message: a replica that misses it learns
// of the overload from its own next 429.
func PublishCooldown(nc *nats.Conn, url string, until time.Time) error {
	data, err := json.Marshal(cooldownMsg{URL: url, Until: until.UTC()})
	if err != nil {
		return err
	}
	return nc.Publish(CooldownSubject, data)
}

// FollowCooldowns applies the cooldowns other replicas publish until ctx
// ends. apply reports whether it extended one (a replica's own message
// comes back to it and changes nothing).
func FollowCooldowns(ctx context.Context, nc *nats.Conn, apply func(url string, until time.Time) bool) error {
	sub, err := nc.Subscribe(CooldownSubject, func(m *nats.Msg) {
		var c cooldownMsg
		if json.Unmarshal(m.Data, &c) == nil && c.URL != "" {
			// Another replica's clock: never more than a minute ahead of ours.
			until := c.Until
			if limit := time.Now().Add(maxCooldown); until.After(limit) {
				until = limit
			}
			apply(c.URL, until)
		}
	})
	if err != nil {
		return fmt.Errorf("subscribe %s: %w", CooldownSubject, err)
	}
	<-ctx.Done()
	_ = sub.Unsubscribe()
	return ctx.Err()
}
