package main

import (
	"context"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sync/errgroup"

	"github.com/kvgate/kvgate/gpu"
	"github.com/kvgate/kvgate/scheduler"
	"github.com/kvgate/kvgate/store"
)

// signals is the running signal path: the relay, the inbox and the feed
// notices, over an external NATS server or an embedded one.
type signals struct {
	relay *scheduler.Relay
	feed  *scheduler.Feed
	// cooldown tells the other replicas of a backend's 429 pause.
	cooldown func(url string, until time.Time)
	run      func(ctx context.Context) error // until ctx ends; then closes the connection and any embedded server
}

// startSignals connects to NATS (cfg.NATS.URL, or an embedded server
// with its files under the data directory and no listening port), creates
// the stream, the consumer and the membership bucket, and builds the
// relay, the inbox and the membership. wake is called for each event that
// may mean runnable work.
//
// An external server that cannot be reached at start does not stop
// kvgate: jobs are accepted and run without it (their events wait in the
// outbox), the connection and the setup are retried in the background,
// and until the setup is done the scheduler keeps to a share of 0 (one
// request per backend at a time: it cannot know whether other replicas
// share the fleet).
func startSignals(ctx context.Context, cfg *config, st store.Store, sched *scheduler.Scheduler, pool *gpu.Pool, wake func(),
	reg prometheus.Registerer, log *slog.Logger) (*signals, error) {
	opts := []nats.Option{nats.Name("kvgate"), nats.MaxReconnects(-1), nats.ReconnectWait(time.Second),
		nats.DisconnectErrHandler(func(_ *nats.Conn, err error) {
			if err != nil {
				log.Warn("nats disconnected", "err", err)
			}
		}),
		nats.ReconnectHandler(func(nc *nats.Conn) { log.Info("nats reconnected", "url", nc.ConnectedUrlRedacted()) }),
	}
	var ns *server.Server
	url := cfg.NATS.URL
	if url == "" {
		var err error
		ns, err = server.NewServer(&server.Options{
			ServerName: "kvgate-embedded", JetStream: true, StoreDir: filepath.Join(cfg.DataDir, "nats"),
			DontListen: true, NoSigs: true, NoLog: true,
		})
		if err != nil {
			return nil, fmt.Errorf("embedded nats: %w", err)
		}
		ns.Start()
		if !ns.ReadyForConnections(30 * time.Second) {
			ns.Shutdown()
			return nil, fmt.Errorf("embedded nats did not start")
		}
		opts = append(opts, nats.InProcessServer(ns))
		url = "in-process"
	} else {
		opts = append(opts, nats.RetryOnFailedConnect(true))
	}
	closeAll := func(nc *nats.Conn) {
		if nc != nil {
			nc.Close()
		}
		if ns != nil {
			ns.Shutdown()
			ns.WaitForShutdown()
		}
	}
	nc, err := nats.Connect(url, opts...)
	if err != nil {
		closeAll(nil)
		return nil, fmt.Errorf("connect to nats %s: %w", url, err)
	}
	js, err := jetstream.New(nc)
	if err != nil {
		closeAll(nc)
		return nil, err
	}
	// Alone or beside other replicas? Not known until membership counts:
	// until then, one request per backend at a time.
	sched.SetShare(0)
	feed := scheduler.NewFeed()
	relay := scheduler.NewRelay(st, js, scheduler.RelayConfig{Logger: log,
		Announce: func() { _ = nc.Publish(scheduler.FeedSubject, nil) }})
	reg.MustRegister(relay.Collectors()...)
	cooldown := func(url string, until time.Time) {
		if err := scheduler.PublishCooldown(nc, url, until); err != nil {
			log.Warn("cooldown not shared", "backend_url", url, "err", err)
		}
	}
	// setup creates what lives on the broker and starts what needs it.
	var inboxMetrics sync.Once
	setup := func(ctx context.Context, g *errgroup.Group) error {
		sctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		cons, err := scheduler.SetupSignals(sctx, js, scheduler.SignalsConfig{Replicas: cfg.NATS.Replicas})
		if err != nil {
			return err
		}
		// Replicas on one fleet share its capacity (scheduler/replicas.go).
		mem, err := scheduler.NewMembership(sctx, js, sched, scheduler.MembershipConfig{ID: replicaID(), Logger: log})
		if err != nil {
			return err
		}
		inbox := scheduler.NewInbox(st, cons, scheduler.InboxConfig{Logger: log,
			Publish: func(ctx context.Context, m *nats.Msg) error { _, err := js.PublishMsg(ctx, m); return err },
			OnEvent: func(e scheduler.Event) {
				if e.State == store.Ready || e.State == store.RetryScheduled {
					wake()
				}
			},
		})
		inboxMetrics.Do(func() {
			reg.MustRegister(inbox.Collectors()...)
			reg.MustRegister(mem.Collectors()...)
		})
		log.Info("signals over nats", "url", url, "stream", scheduler.StreamName)
		g.Go(func() error { return ignoreCanceled(inbox.Run(ctx)) })
		g.Go(func() error { return ignoreCanceled(mem.Run(ctx)) })
		return nil
	}
	return &signals{relay: relay, feed: feed, cooldown: cooldown, run: func(ctx context.Context) error {
		g, gctx := errgroup.WithContext(ctx)
		g.Go(func() error { return ignoreCanceled(relay.Run(gctx)) })
		g.Go(func() error { return ignoreCanceled(scheduler.FollowFeed(gctx, nc, feed)) })
		g.Go(func() error { return ignoreCanceled(scheduler.FollowCooldowns(gctx, nc, pool.CooldownURL)) })
		g.Go(func() error {
			for failures := 1; ; failures++ {
				err := setup(gctx, g)
				if err == nil || gctx.Err() != nil {
					return nil
				}
				wait := min(30*time.Second, time.Second<<min(failures-1, 5))
				log.Warn("nats setup failed; jobs still run, their events wait in the outbox", "url", url, "err", err, "retry_in", wait)
				select {
				case <-gctx.Done():
					return nil
				case <-time.After(wait):
				}
			}
		})
		err := g.Wait()
		closeAll(nc)
		return err
	}}, nil
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
