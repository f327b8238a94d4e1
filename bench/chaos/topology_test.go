package chaos

import (
	"context"
	"database/sql"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"go.yaml.in/yaml/v3"

	"github.com/kvgate/kvgate/scheduler"
)

// natsNode is one nats-server of a three-node JetStream cluster, on its
// own client, cluster and monitoring ports and store directory.
type natsNode struct {
	name                   string
	port, cluster, monitor int
	dir                    string
	p                      *proc
}

func (n *natsNode) url() string { return fmt.Sprintf("nats://127.0.0.1:%d", n.port) }

// startNATSCluster starts three clustered nats-servers with JetStream, as
// deploy/compose runs them, and waits until each is healthy with JetStream
// on. It never touches the machine's own NATS (4222): every port is a
// free one.
func startNATSCluster(t *testing.T, dir string) []*natsNode {
	t.Helper()
	nodes := make([]*natsNode, 3)
	for i := range nodes {
		nodes[i] = &natsNode{name: fmt.Sprintf("nats-%d", i+1), port: freePort(t), cluster: freePort(t), monitor: freePort(t),
			dir: filepath.Join(dir, fmt.Sprintf("nats-%d", i+1))}
	}
	for _, n := range nodes {
		var routes []string
		for _, o := range nodes {
			if o != n {
				routes = append(routes, fmt.Sprintf("nats://127.0.0.1:%d", o.cluster))
			}
		}
		n.p = startProc(t, dir, n.name, suite.nats, "--name", n.name, "-a", "127.0.0.1", "-p", strconv.Itoa(n.port),
			"-m", strconv.Itoa(n.monitor), "--jetstream", "--store_dir", n.dir,
			"--cluster_name", "kvgate-chaos", "--cluster", fmt.Sprintf("nats://127.0.0.1:%d", n.cluster),
			"--routes", strings.Join(routes, ","))
	}
	for _, n := range nodes {
		health := fmt.Sprintf("http://127.0.0.1:%d/healthz?js-enabled-only=true", n.monitor)
		eventually(t, 60*time.Second, 100*time.Millisecond, n.name+" healthy", func() (bool, string, error) {
			if n.p.exited() {
				return false, "", fmt.Errorf("%w: %s exited: %v\n%s", errStop, n.name, n.p.err, n.p.tail(20))
			}
			resp, err := http.Get(health)
			if err != nil {
				return false, err.Error(), nil
			}
			resp.Body.Close()
			return resp.StatusCode == http.StatusOK, resp.Status, nil
		})
	}
	return nodes
}

// startReplica starts kvgate serve number i on the scenario's store and
// the whole NATS cluster, with kvgate's streams replicated three times.
func startReplica(e *env, i int, nodes []*natsNode) *gateway {
	e.t.Helper()
	g := &gateway{e: e, addr: fmt.Sprintf("127.0.0.1:%d", freePort(e.t)), config: filepath.Join(e.dir, fmt.Sprintf("kvgate-%d.yaml", i))}
	var c gatewayConfig
	c.Addr, c.Store, c.DataDir, c.LogLevel = g.addr, e.dbURL, filepath.Join(e.dir, fmt.Sprintf("data-%d", i)), "info"
	for _, s := range e.sims {
		c.Backends = append(c.Backends, backendConfig{Name: s.name, URL: s.url(), Models: []string{simModel}})
	}
	c.APIKeys = []apiKeyConfig{{Key: staticKey, Tenant: userTenant}}
	var urls []string
	for _, n := range nodes {
		urls = append(urls, n.url())
	}
	c.NATS.URL, c.NATS.Replicas = strings.Join(urls, ","), 3
	c.NVML.Disabled = true
	c.Jobs.MaxAttempts, c.Jobs.Lease = e.opts.maxAttempts, e.opts.lease
	b, err := yaml.Marshal(c)
	if err != nil {
		e.t.Fatal(err)
	}
	if err := os.WriteFile(g.config, b, 0o644); err != nil {
		e.t.Fatal(err)
	}
	name := fmt.Sprintf("kvgate-%d", i)
	g.p = startProc(e.t, e.dir, name, suite.bin, "serve", "--config", g.config)
	e.t.Cleanup(func() {
		if e.t.Failed() {
			e.t.Logf("last lines of %s's log:\n%s", name, tailFile(g.p.log, 40))
		}
	})
	eventually(e.t, 60*time.Second, 100*time.Millisecond, name+" ready", func() (bool, string, error) {
		if err := g.alive(); err != nil {
			return false, "", err
		}
		resp, err := http.Get(g.base() + "/readyz")
		if err != nil {
			return false, err.Error(), nil
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK, resp.Status, nil
	})
	return g
}

// eventsStream returns the events stream's info as the cluster reports
// it.
func eventsStream(t *testing.T, nodes []*natsNode) *jetstream.StreamInfo {
	t.Helper()
	var urls []string
	for _, n := range nodes {
		if !n.p.exited() {
			urls = append(urls, n.url())
		}
	}
	nc, err := nats.Connect(strings.Join(urls, ","))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	var info *jetstream.StreamInfo
	eventually(t, 30*time.Second, 200*time.Millisecond, "the events stream's info", func() (bool, string, error) {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		s, err := js.Stream(ctx, scheduler.StreamName)
		if err != nil {
			return false, err.Error(), nil
		}
		info = s.CachedInfo()
		return info.Cluster != nil && info.Cluster.Leader != "", "no leader yet", nil
	})
	return info
}

// TestProductionTopology runs the production topology natively, as
// deploy/compose lays it out: three nats-server processes clustered with
// JetStream, two kvgate serve replicas on one PostgreSQL database with the
// events stream replicated three times, and two simulators. Jobs are
// submitted to both replicas at once; mid-burst, the NATS node leading
// the events stream is killed (kill -9). Every job must succeed with the
// suite's invariants (no attempt lost or doubled) and one attempt spent
// each (a broker outage spends none), the stream must elect a
// leader on the two nodes left, and the outbox must publish everything.
// About 15 s: it is in the short subset (CI, make chaos-short).
func TestProductionTopology(t *testing.T) {
	need(t, "short")
	opts := options{sims: 2, speedup: 4, maxAttempts: 5, lease: 15 * time.Second}
	dir := filepath.Join(suite.dir, strings.ReplaceAll(t.Name(), "/", "_"))
	os.RemoveAll(dir)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	e := &env{t: t, dir: dir, opts: opts, client: &http.Client{Timeout: 15 * time.Second},
		start: time.Now(), accepted: map[string]string{}}
	t.Cleanup(func() {
		if t.Failed() || suite.keep {
			t.Logf("logs of this scenario: %s", dir)
			return
		}
		os.RemoveAll(dir)
	})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var err error
	if e.dbURL, err = suite.pg.createDB(ctx, dbName(t.Name())); err != nil {
		t.Fatal(err)
	}
	if e.db, err = sql.Open("pgx", e.dbURL); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.db.Close() })

	nodes := startNATSCluster(t, dir)
	e.mark("three nats-servers clustered")
	for i := range opts.sims {
		e.sims = append(e.sims, &sim{e: e, name: fmt.Sprintf("sim%d", i), port: freePort(t), seed: i + 1})
	}
	e.startSims()
	gws := []*gateway{startReplica(e, 1, nodes), startReplica(e, 2, nodes)}
	e.gw = gws[0] // the env's helpers watch the first; both are checked below
	e.waitModel()
	e.mark("two kvgate replicas ready")

	info := eventsStream(t, nodes)
	if info.Config.Replicas != 3 || len(info.Cluster.Replicas) != 2 {
		t.Fatalf("events stream %s: %d replicas configured, %d followers of %s; want 3 and 2",
			scheduler.StreamName, info.Config.Replicas, len(info.Cluster.Replicas), info.Cluster.Leader)
	}
	leader := slices.IndexFunc(nodes, func(n *natsNode) bool { return n.name == info.Cluster.Leader })
	if leader < 0 {
		t.Fatalf("stream leader %q is none of the nodes", info.Cluster.Leader)
	}
	e.mark("events stream R3, leader %s", info.Cluster.Leader)

	bothAlive := func() error {
		for _, g := range gws {
			if err := g.alive(); err != nil {
				return err
			}
		}
		return nil
	}
	waitA := e.submitInBackground(batch{name: "topo-a", n: 150, maxTokens: 64, base: gws[0].base()})
	waitB := e.submitInBackground(batch{name: "topo-b", n: 150, maxTokens: 64, base: gws[1].base()})
	e.waitKeys("topo-", 60, 2*time.Minute)
	nodes[leader].p.kill()
	e.logStates("kill -9 " + nodes[leader].name + " (the events stream's leader)")
	waitA()
	waitB()
	if len(e.accepted) != 300 {
		t.Fatalf("%d of 300 jobs accepted", len(e.accepted))
	}
	e.waitFinal(3 * time.Minute)
	if err := bothAlive(); err != nil {
		t.Fatal(err)
	}
	after := eventsStream(t, nodes)
	if after.Cluster.Leader == nodes[leader].name {
		t.Errorf("the killed node %s still leads the events stream", nodes[leader].name)
	}
	e.mark("events stream leader now %s", after.Cluster.Leader)
	// Every event reached the stream on the two nodes left.
	eventually(t, time.Minute, 250*time.Millisecond, "the outbox published", func() (bool, string, error) {
		var n int
		err := e.db.QueryRowContext(context.Background(), `SELECT count(*) FROM outbox WHERE published_at <= 0`).Scan(&n)
		return err == nil && n == 0, fmt.Sprintf("%d event(s) unpublished", n), err
	})
	e.mark("outbox published; the stream holds %d messages", eventsStream(t, nodes).State.Msgs)
	// Both replicas ran jobs: each counts some it brought to SUCCEEDED.
	for i, g := range gws {
		if n, err := succeededOn(g); err != nil || n == 0 {
			t.Errorf("kvgate-%d brought %v jobs to SUCCEEDED (%v): want both replicas running jobs", i+1, n, err)
		} else {
			e.mark("kvgate-%d ran %.0f jobs to SUCCEEDED", i+1, n)
		}
	}
	e.finish(expectOneSpent)
}

// succeededOn reads kvgate_scheduler_jobs_finished_total{outcome="succeeded"}
// from a replica's /metrics.
func succeededOn(g *gateway) (float64, error) {
	resp, err := http.Get(g.base() + "/metrics")
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	parser := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := parser.TextToMetricFamilies(resp.Body)
	if err != nil {
		return 0, err
	}
	var n float64
	if f := fams["kvgate_scheduler_jobs_finished_total"]; f != nil {
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "outcome" && l.GetValue() == "succeeded" {
					n += m.GetCounter().GetValue()
				}
			}
		}
	}
	return n, nil
}
