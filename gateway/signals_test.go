package gateway

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvgate/kvgate/scheduler"
	"github.com/kvgate/kvgate/store"
)

// testSignals is kvgate's signal path on a real NATS server with
// JetStream: the relay, the inbox and the feed notices.
type testSignals struct {
	ns    *server.Server
	nc    *nats.Conn
	feed  *scheduler.Feed
	relay *scheduler.Relay
	inbox *scheduler.Inbox
}

// startTestNATS runs a real NATS server with JetStream on a loopback
// port until the test ends.
func startTestNATS(t testing.TB) *server.Server {
	t.Helper()
	ns, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: server.RANDOM_PORT, JetStream: true,
		StoreDir: t.TempDir(), NoLog: true, NoSigs: true})
	if err != nil {
		t.Fatal(err)
	}
	ns.Start()
	t.Cleanup(ns.Shutdown)
	if !ns.ReadyForConnections(10 * time.Second) {
		t.Fatal("nats server did not start")
	}
	return ns
}

func startTestSignals(t testing.TB, st store.Store, wake func()) *testSignals {
	t.Helper()
	ns := startTestNATS(t)
	nc, err := nats.Connect(ns.ClientURL(), nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	cons, err := scheduler.SetupSignals(context.Background(), js, scheduler.SignalsConfig{})
	if err != nil {
		t.Fatal(err)
	}
	s := &testSignals{ns: ns, nc: nc, feed: scheduler.NewFeed()}
	s.relay = scheduler.NewRelay(st, js, scheduler.RelayConfig{Poll: 20 * time.Millisecond, AckTimeout: time.Second,
		Announce: func(tenants []string) { _ = nc.Publish(scheduler.FeedSubject, scheduler.FeedNotice(tenants)) }})
	s.inbox = scheduler.NewInbox(st, cons, scheduler.InboxConfig{MaxWait: 200 * time.Millisecond,
		OnEvent: func(scheduler.Event) { wake() }})
	return s
}

func (s *testSignals) run(ctx context.Context, wg *sync.WaitGroup) {
	wg.Go(func() { _ = s.relay.Run(ctx) })
	wg.Go(func() { _ = s.inbox.Run(ctx) })
	wg.Go(func() { _ = scheduler.FollowFeed(ctx, s.nc, s.feed) })
}
