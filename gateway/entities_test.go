package gateway

import (
	"context"

	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/kvgate/kvgate/bench/eventually"
	"github.com/kvgate/kvgate/bench/vllmsim"
	"github.com/kvgate/kvgate/store"
	"github.com/kvgate/kvgate/store/postgres/pgtest"
)

// entityJob is a chat job for an entity version that generates tokens
// tokens (ignore_eos: exactly that many).
func entityJob(key string, version int64, ordering string, tokens int) string {
	o := ""
	if ordering != "" {
		o = fmt.Sprintf(`"ordering":%q,`, ordering)
	}
	return fmt.Sprintf(`{"endpoint":"/v1/chat/completions","entity":{"key":%q,"version":%d},%s"body":{"model":%q,`+
		`"messages":[{"role":"user","content":"%s v%d"}],"max_tokens":%d,"ignore_eos":true}}`, key, version, o, llama, key, version, tokens)
}

func postTo(t *testing.T, base, path, body string, header ...string) (int, []byte) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, base+path, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, b
}

// TestEntityOrderingTwoReplicasPostgres: two replicas on one PostgreSQL
// store run the versions of many entities, each version 1 slow and its
// version 2 quick, submitted through different replicas so that they
// finish out of order. Latest wins: every version 2 SUCCEEDED and every
// version 1 that ended after it is SUPERSEDED, its result withheld; a
// version 1 never succeeds after its version 2. Serial entities run
// their versions one at a time, in order. GET /v1/entities/{key} shows
// the versions.
func TestEntityOrderingTwoReplicasPostgres(t *testing.T) {
	p := llamaProfile(t)
	var urls []string
	for i := range 2 {
		_, srv := vllmsim.NewTestServer(t, vllmsim.Config{Profile: p, Speedup: 20, Seed: uint64(i)})
		urls = append(urls, srv.URL)
	}
	st := pgtest.Open(t)
	reps := startReplicas(t, 2, urls, st, false)
	const entities = 8
	type pair struct{ v1, v2 string }
	latest := make([]pair, entities)
	for i := range entities {
		key := fmt.Sprint("invoice-", i)
		for v, rep := range map[int64]*replica{1: reps[0], 2: reps[1]} {
			tokens := 300 // version 1 is slow
			if v == 2 {
				tokens = 2
			}
			status, b := postTo(t, rep.srv.URL, "/v1/jobs", entityJob(key, v, "", tokens), "Idempotency-Key", fmt.Sprint(key, "-", v))
			if status != http.StatusAccepted {
				t.Fatalf("submit %s v%d: %d %s", key, v, status, b)
			}
			id := decode[jobView](t, b).ID
			if v == 1 {
				latest[i].v1 = id
			} else {
				latest[i].v2 = id
			}
		}
	}
	// A second job for a version is refused.
	if status, b := postTo(t, reps[0].srv.URL, "/v1/jobs", entityJob("invoice-0", 2, "", 2), "Idempotency-Key", "dup"); status != http.StatusConflict ||
		!strings.Contains(string(b), "entity_version_exists") {
		t.Errorf("a second job for invoice-0 v2: %d %s", status, b)
	}
	serial := [2]string{}
	for v, tokens := range []int{300, 2} {
		status, b := postTo(t, reps[v].srv.URL, "/v1/jobs", entityJob("contract", int64(v+1), "serial", tokens), "Idempotency-Key", fmt.Sprint("contract-", v))
		if status != http.StatusAccepted {
			t.Fatalf("submit contract v%d: %d %s", v+1, status, b)
		}
		serial[v] = decode[jobView](t, b).ID
	}

	ctx := context.Background()
	final := func(id string) store.Job {
		var j store.Job
		eventually.True(t, "job "+id+" to end", func() bool {
			var err error
			j, err = st.Get(ctx, "default", id)
			return err == nil && j.State.Final()
		})
		return j
	}
	// The order the completions took the entity's lock is the order of
	// their events (written under it); the jobs' times are each replica's
	// clock before the transaction, and say nothing of that order.
	for _, pr := range latest {
		final(pr.v1)
		final(pr.v2)
	}
	evs, err := st.Unpublished(ctx, 100_000)
	if err != nil {
		t.Fatal(err)
	}
	finalSeq := map[string]int64{}
	for _, e := range evs {
		if e.State.Final() {
			finalSeq[e.JobID] = e.Seq
		}
	}
	superseded := 0
	for i, pr := range latest {
		j1, j2 := final(pr.v1), final(pr.v2)
		if j2.State != store.Succeeded {
			t.Errorf("invoice-%d v2: %s", i, j2.State)
		}
		switch j1.State {
		case store.Superseded:
			superseded++
			if status, _ := getFrom(t, reps[0].srv.URL, "/v1/jobs/"+pr.v1+"/result"); status != http.StatusConflict {
				t.Errorf("invoice-%d v1 was superseded, yet its result is delivered: %d", i, status)
			}
		case store.Succeeded:
			if finalSeq[pr.v1] > finalSeq[pr.v2] {
				t.Errorf("invoice-%d: v1 SUCCEEDED after v2 had (events %d, %d)", i, finalSeq[pr.v1], finalSeq[pr.v2])
			}
		default:
			t.Errorf("invoice-%d v1: %s", i, j1.State)
		}
	}
	t.Logf("%d of %d version 1s were superseded", superseded, entities)
	if superseded == 0 {
		t.Errorf("no version 1 finished after its version 2: the test did not finish versions out of order")
	}
	status, b := getFrom(t, reps[1].srv.URL, "/v1/entities/invoice-0")
	ev := decode[entityView](t, b)
	if status != 200 || ev.LatestVersion != 2 || ev.LatestJob != latest[0].v2 || ev.WonVersion != 2 || len(ev.Versions) != 2 {
		t.Errorf("entity: %d %s", status, b)
	}
	if status, b := getFrom(t, reps[0].srv.URL, "/v1/jobs/"+latest[0].v1); status != 200 || !strings.Contains(string(b), `"entity":{"key":"invoice-0","version":1}`) {
		t.Errorf("the job's view does not name its entity version: %d %s", status, b)
	}
	if status, _ := getFrom(t, reps[1].srv.URL, "/v1/entities/no-such"); status != http.StatusNotFound {
		t.Errorf("an unknown entity: %d", status)
	}

	// Serial: v2 (quick) waited for v1 (slow) and ran after it.
	s1, s2 := final(serial[0]), final(serial[1])
	if s1.State != store.Succeeded || s2.State != store.Succeeded {
		t.Fatalf("serial: %s, %s", s1.State, s2.State)
	}
	a1, _ := st.Attempts(ctx, s1.ID)
	a2, _ := st.Attempts(ctx, s2.ID)
	var end1 = a1[len(a1)-1].EndedAt
	ran := a2[len(a2)-1]
	if ran.Outcome != store.OutcomeSucceeded || ran.StartedAt.Before(end1) {
		t.Errorf("serial v2 ran from %v; v1 ended at %v", ran.StartedAt, end1)
	}
	waited := 0
	for _, a := range a2 {
		if a.ErrorClass == "entity_ordering" && !a.Spent {
			waited++
		}
	}
	// A v2 first claimed while v1 ran must have waited (it ran after v1
	// ended); one first claimed once v1 had ended (a loaded host runs v1
	// before it claims v2) had nothing to wait for.
	switch first := a2[0]; {
	case first.StartedAt.Before(end1) && waited == 0:
		t.Errorf("serial v2, claimed while v1 ran, never waited for v1: %+v", a2)
	case !first.StartedAt.Before(end1):
		t.Logf("serial v2 was first claimed after v1 ended (%v, %v): nothing to wait for", first.StartedAt, end1)
	}
}

func getFrom(t *testing.T, base, path string) (int, []byte) {
	t.Helper()
	resp, err := http.Get(base + path)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, b
}
