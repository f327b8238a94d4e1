package scheduler

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sync/errgroup"

	"github.com/kvgate/kvgate/store"
)

// brokerStore is what the broker's relay and inbox need of the store.
type brokerStore interface {
	outboxStore
	inboxStore
}

// BrokerConfig configures the NATS side of kvgate.
type BrokerConfig struct {
	// URL of an external NATS server; "" starts an embedded one with its
	// files under DataDir/nats and no listening port.
	URL     string
	DataDir string
	// Replicas of the events stream (an external cluster only).
	Replicas int
	// Options are more connection options for an external server: TLS
	// (nats.Secure) and credentials (nats.UserInfo, NkeyOptionFromSeed,
	// UserCredentials).
	Options []nats.Option
	// Wake is called for each event that may mean runnable work.
	Wake func()
	// OnEvent, when set, hears every event the inbox records, once
	// fleet-wide (the completion latency histogram).
	OnEvent func(Event)
	// ApplyCooldown applies another replica's 429 pause of a backend;
	// *gpu.Pool's CooldownURL satisfies it.
	ApplyCooldown func(url string, until time.Time) bool
	Registerer    prometheus.Registerer
	Logger        *slog.Logger
}

// Broker is the running signal path over NATS JetStream: the outbox
// relay, the inbox, the feed notices, the shared cooldowns and the replica
// membership. Start builds it; Run runs it.
type Broker struct {
	// Relay publishes the outbox; wake it after committing events.
	Relay *Relay
	// Feed wakes event streams when events are published.
	Feed *Feed

	nc  *nats.Conn
	js  jetstream.JetStream
	ns  *server.Server // the embedded server, if any
	url string
	cfg BrokerConfig
	st  brokerStore
	sch *Scheduler
	log *slog.Logger
	// cons is the inbox consumer once set up: InboxPending reads it.
	cons atomic.Pointer[jetstream.Consumer]
}

// StartBroker connects to NATS (or starts the embedded server) and builds
// the relay and the feed. What lives on the broker (the stream, the
// consumer, the membership bucket) is set up by Run, and retried there:
// an external server that cannot be reached at start does not stop
// kvgate. Jobs are accepted and run without it (their events wait in the
// outbox), and until the setup is done the scheduler keeps to a share of
// 0 (one request per backend at a time: it cannot know whether other
// replicas share the fleet).
func StartBroker(st brokerStore, sched *Scheduler, cfg BrokerConfig) (*Broker, error) {
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	reg := cfg.Registerer
	if reg == nil {
		reg = prometheus.NewRegistry()
	}
	cfg.Registerer = reg
	opts := []nats.Option{nats.Name("kvgate"), nats.MaxReconnects(-1), nats.ReconnectWait(time.Second),
		nats.DisconnectErrHandler(func(_ *nats.Conn, err error) {
			if err != nil {
				log.Warn("nats disconnected", "err", err)
			}
		}),
		nats.ReconnectHandler(func(nc *nats.Conn) { log.Info("nats reconnected", "url", nc.ConnectedUrlRedacted()) }),
	}
	b := &Broker{cfg: cfg, st: st, sch: sched, log: log, url: cfg.URL}
	if b.url == "" {
		ns, err := server.NewServer(&server.Options{
			ServerName: "kvgate-embedded", JetStream: true, StoreDir: filepath.Join(cfg.DataDir, "nats"),
			DontListen: true, NoSigs: true, NoLog: true,
		})
		if err != nil {
			return nil, fmt.Errorf("embedded nats: %w", err)
		}
		ns.Start()
		if !ns.ReadyForConnections(30 * time.Second) {
			ns.Shutdown()
			return nil, errors.New("embedded nats did not start")
		}
		b.ns = ns
		opts = append(opts, nats.InProcessServer(ns))
		b.url = "in-process"
	} else {
		opts = append(opts, nats.RetryOnFailedConnect(true))
		opts = append(opts, cfg.Options...)
	}
	nc, err := nats.Connect(b.url, opts...)
	if err != nil {
		b.close()
		return nil, fmt.Errorf("connect to nats %s: %w", redactURLs(b.url), err)
	}
	b.nc = nc
	if b.js, err = NewJetStream(nc, DefaultAckTimeout); err != nil {
		b.close()
		return nil, err
	}
	// Alone or beside other replicas? Not known until membership counts:
	// until then, one request per backend at a time.
	sched.SetShare(0)
	b.Feed = NewFeed()
	b.Relay = NewRelay(st, b.js, RelayConfig{Logger: log,
		Announce: func(tenants []string) { _ = nc.Publish(FeedSubject, FeedNotice(tenants)) }})
	reg.MustRegister(b.Relay.Collectors()...)
	return b, nil
}

// Cooldown tells the other replicas of a backend's 429 pause.
func (b *Broker) Cooldown(url string, until time.Time) {
	if err := PublishCooldown(b.nc, url, until); err != nil {
		b.log.Warn("cooldown not shared", "backend_url", url, "err", err)
	}
}

// Run runs the relay, the feed and cooldown followers, and (once the
// broker's setup succeeds, retried with backoff) the inbox and the
// membership, until ctx ends; then it closes the connection and any
// embedded server. It returns nil on cancellation.
func (b *Broker) Run(ctx context.Context) error {
	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error { return ignoreCanceled(b.Relay.Run(gctx)) })
	g.Go(func() error { return ignoreCanceled(FollowFeed(gctx, b.nc, b.Feed)) })
	if b.cfg.ApplyCooldown != nil {
		g.Go(func() error { return ignoreCanceled(FollowCooldowns(gctx, b.nc, b.cfg.ApplyCooldown)) })
	}
	var metrics sync.Once
	g.Go(func() error {
		for failures := 1; ; failures++ {
			err := b.setup(gctx, g, &metrics)
			if err == nil || gctx.Err() != nil {
				return nil
			}
			wait := min(30*time.Second, time.Second<<min(failures-1, 5))
			b.log.Warn("nats setup failed; jobs still run, their events wait in the outbox", "url", redactURLs(b.url), "err", err, "retry_in", wait)
			select {
			case <-gctx.Done():
				return nil
			case <-time.After(wait):
			}
		}
	})
	err := g.Wait()
	b.close()
	return err
}

// setup creates what lives on the broker and starts what needs it.
func (b *Broker) setup(ctx context.Context, g *errgroup.Group, metrics *sync.Once) error {
	sctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	cons, err := SetupSignals(sctx, b.js, SignalsConfig{Replicas: b.cfg.Replicas})
	if err != nil {
		return err
	}
	// Replicas on one fleet share its capacity (replicas.go).
	mem, err := NewMembership(sctx, b.js, b.sch, MembershipConfig{ID: replicaID(), Logger: b.log})
	if err != nil {
		return err
	}
	inbox := NewInbox(b.st, cons, InboxConfig{Logger: b.log,
		Publish: func(ctx context.Context, m *nats.Msg) (*jetstream.PubAck, error) { return b.js.PublishMsg(ctx, m) },
		OnEvent: func(e Event) {
			if b.cfg.Wake != nil && (e.State == store.Ready || e.State == store.RetryScheduled) {
				b.cfg.Wake()
			}
			if b.cfg.OnEvent != nil {
				b.cfg.OnEvent(e)
			}
		},
	})
	metrics.Do(func() {
		b.cfg.Registerer.MustRegister(inbox.Collectors()...)
		b.cfg.Registerer.MustRegister(mem.Collectors()...)
	})
	b.cons.Store(&cons)
	b.log.Info("signals over nats", "url", redactURLs(b.url), "stream", StreamName)
	g.Go(func() error { return ignoreCanceled(inbox.Run(ctx)) })
	g.Go(func() error { return ignoreCanceled(mem.Run(ctx)) })
	g.Go(func() error {
		return ignoreCanceled(KeepSignals(ctx, b.js, SignalsConfig{Replicas: b.cfg.Replicas}, mem.cfg.TTL, 10*time.Second, b.log))
	})
	return nil
}

// KeepSignals looks every interval for what SetupSignals and the
// membership made on the broker, and makes again what is gone: a server
// that restarted without its storage (and the membership bucket, in
// memory, after any restart) would otherwise leave the relay, the inbox
// and the membership failing until kvgate restarts. The inbox's consumer
// and the bucket are used by name, so they work again as they were.
func KeepSignals(ctx context.Context, js jetstream.JetStream, cfg SignalsConfig, memberTTL, interval time.Duration, log *slog.Logger) error {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
		cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		gone, err := signalsGone(cctx, js)
		if err == nil && gone != "" {
			log.Warn("nats lost kvgate's "+gone+": making it again", "stream", StreamName)
			if _, err = SetupSignals(cctx, js, cfg); err == nil {
				_, err = js.CreateOrUpdateKeyValue(cctx, membershipBucket(memberTTL))
			}
		}
		cancel()
		if err != nil && ctx.Err() == nil {
			// A broker out of reach: the relay says so already.
			log.Debug("checking kvgate's stream on nats", "err", err)
		}
	}
}

// signalsGone names what of kvgate's is missing on the broker ("" when
// nothing is).
func signalsGone(ctx context.Context, js jetstream.JetStream) (string, error) {
	if _, err := js.Stream(ctx, StreamName); errors.Is(err, jetstream.ErrStreamNotFound) {
		return "stream", nil
	} else if err != nil {
		return "", err
	}
	if _, err := js.Consumer(ctx, StreamName, InboxConsumer); errors.Is(err, jetstream.ErrConsumerNotFound) {
		return "inbox consumer", nil
	} else if err != nil {
		return "", err
	}
	if _, err := js.KeyValue(ctx, MembershipBucket); errors.Is(err, jetstream.ErrBucketNotFound) {
		return "membership bucket", nil
	} else if err != nil {
		return "", err
	}
	return "", nil
}

func (b *Broker) close() {
	if b.nc != nil {
		b.nc.Close()
	}
	if b.ns != nil {
		b.ns.Shutdown()
		b.ns.WaitForShutdown()
	}
}

func ignoreCanceled(err error) error {
	if errors.Is(err, context.Canceled) {
		return nil
	}
	return err
}

// replicaID names this process among the replicas: host, process id and a
// random suffix, so that a restart is a new member.
func replicaID() string {
	host, _ := os.Hostname()
	return fmt.Sprintf("%s-%d-%08x", subjectSafe(host), os.Getpid(), rand.Uint32())
}

// subjectSafe keeps the characters a key-value key may hold.
func subjectSafe(s string) string {
	return strings.Map(func(r rune) rune {
		switch {
		case r >= 'a' && r <= 'z', r >= 'A' && r <= 'Z', r >= '0' && r <= '9', r == '-', r == '_':
			return r
		}
		return '_'
	}, s)
}

// redactURLs is a NATS server list (comma-separated URLs) fit for logs
// and errors: a password in a URL is replaced by xxxxx, and a user token
// (nats://TOKEN@host) by one too.
func redactURLs(list string) string {
	parts := strings.Split(list, ",")
	for i, p := range parts {
		u, err := url.Parse(strings.TrimSpace(p))
		if err != nil || u.User == nil {
			continue
		}
		if _, has := u.User.Password(); has {
			parts[i] = u.Redacted()
		} else {
			u.User = url.User("xxxxx")
			parts[i] = u.String()
		}
	}
	return strings.Join(parts, ",")
}
