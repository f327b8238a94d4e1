package gateway

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/chromedp/chromedp"

	"github.com/kvgate/kvgate/bench/eventually"
	"github.com/kvgate/kvgate/scheduler/validate"
	"github.com/kvgate/kvgate/store"
)

// TestConsoleBrowser drives the console in headless Chromium (Debian's
// chromium) against a real simulator fleet: sign in, the fleet's KV use
// moving under load, a review approved, a dead letter replayed, a key
// rotated; a user key, another tenant's operator and a signed-out browser
// refused. Every page is checked by axe-core (no serious or critical
// violation) and saved as a screenshot under $KVGATE_ARTIFACTS/console (a
// temporary directory without it). Without chromium it skips, unless
// CI=true.
func TestConsoleBrowser(t *testing.T) {
	ci := os.Getenv("CI") == "true"
	exe := ""
	for _, name := range []string{"chromium", "chromium-browser"} {
		if p, err := exec.LookPath(name); err == nil {
			exe = p
			break
		}
	}
	if exe == "" {
		if ci {
			t.Fatal("chromium is not on PATH; CI=true requires it for the console's browser test (apt-get install chromium)")
		}
		t.Skip("chromium is not on PATH: skipping the console's browser test (apt-get install chromium; with CI=true this fails)")
	}
	axeSrc := axeSource(t, ci)
	artifacts := t.TempDir()
	if d := os.Getenv("KVGATE_ARTIFACTS"); d != "" {
		artifacts = filepath.Join(d, "console")
		if err := os.MkdirAll(artifacts, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	t.Logf("console screenshots in %s", artifacts)

	e := startConsoleEnv(t)
	base := e.f.srv.URL

	alloc, cancelAlloc := chromedp.NewExecAllocator(context.Background(),
		chromedp.ExecPath(exe), chromedp.UserDataDir(t.TempDir()),
		chromedp.Flag("headless", true), chromedp.NoSandbox, chromedp.DisableGPU,
		chromedp.Flag("disable-background-networking", true), chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true), chromedp.NoFirstRun, chromedp.NoDefaultBrowserCheck,
		chromedp.WindowSize(1280, 900))
	defer cancelAlloc()
	ctx, cancelCtx := chromedp.NewContext(alloc)
	defer cancelCtx()
	ctx, cancelTimeout := context.WithTimeout(ctx, 5*time.Minute)
	defer cancelTimeout()

	run := func(what string, steps ...chromedp.Action[chromedp.Void]) {
		t.Helper()
		if err := chromedp.Do(ctx, steps...); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
	}
	str := func(what string, a chromedp.Action[string]) string {
		t.Helper()
		v, err := chromedp.Run(ctx, a)
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		return v
	}
	shot := func(name string) {
		t.Helper()
		png, err := chromedp.Run(ctx, chromedp.FullScreenshot(100))
		if err != nil {
			t.Fatalf("screenshot %s: %v", name, err)
		}
		if err := os.WriteFile(filepath.Join(artifacts, name+".png"), png, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	// axe checks the page as it is now.
	axe := func(name string) {
		t.Helper()
		if _, err := chromedp.Run(ctx, chromedp.Evaluate[bool](axeSrc+"\n;true")); err != nil {
			t.Fatalf("axe-core on %s: %v", name, err)
		}
		out := str("axe on "+name, chromedp.Evaluate[string](`axe.run(document, {resultTypes: ["violations"]}).then(r =>
			JSON.stringify(r.violations.filter(v => v.impact === "serious" || v.impact === "critical")
				.map(v => ({id: v.id, impact: v.impact, help: v.help, nodes: v.nodes.map(n => n.target.join(" "))}))))`,
			chromedp.EvalAwaitPromise))
		if out != "[]" {
			t.Errorf("axe on %s: serious or critical violations: %s", name, out)
		}
	}
	signIn := func(key string) {
		t.Helper()
		run("sign in", chromedp.Navigate(base+"/console/signin?next=/console/jobs"), chromedp.WaitVisible(chromedp.ID(`key`)),
			chromedp.SendKeys(chromedp.ID(`key`), key), chromedp.Submit(chromedp.ID(`key`)))
	}
	signOut := func() {
		t.Helper()
		run("sign out", chromedp.Click(chromedp.CSS(`form.signout button`)), chromedp.WaitVisible(chromedp.ID(`key`)))
	}
	// textOf reads an element's visible text in one evaluation, waiting for it to
	// exist: the live pages replace their rows on every update, so a node
	// found by one call may be gone by the next.
	textOf := func(what, sel string) string {
		t.Helper()
		v, err := chromedp.Run(ctx, chromedp.Poll[[]string](`(() => {
			const e = document.querySelector(`+jsString(sel)+`);
			return e ? [e.innerText.trim()] : null;
		})()`, chromedp.WithPollingTimeout(30*time.Second)))
		if err != nil || len(v) != 1 {
			t.Fatalf("%s (%s): %v", what, sel, err)
		}
		return v[0]
	}
	bodyText := func() string { return textOf("read the page", `body`) }

	// Signed out: the console sends the browser to the sign-in form.
	run("signed out", chromedp.Navigate(base+"/console/reviews"), chromedp.WaitVisible(chromedp.ID(`key`)))
	shot("signin")
	axe("signin")

	// A user key is refused.
	signIn(e.user)
	run("a user key", chromedp.WaitVisible(chromedp.CSS(`.error`)))
	if s := bodyText(); !strings.Contains(s, "operator or admin") {
		t.Errorf("a user key's sign-in: %s", s)
	}

	// acme's operator; the keyboard reaches the skip link first.
	signIn(e.operator)
	run("signed in", chromedp.WaitVisible(chromedp.ID(`jobs`)))
	run("keyboard", chromedp.KeyEvent("\t"))
	focused := str("focus", chromedp.Evaluate[string](`document.activeElement.className`))
	if focused != "skip" {
		t.Errorf("the first Tab focuses %q, want the skip link", focused)
	}
	shot("jobs")
	axe("jobs")

	// Fleet: KV use moves while load runs on the simulator.
	run("fleet", chromedp.Navigate(base+"/console/fleet"), chromedp.WaitVisible(chromedp.CSS(`[data-backend="sim0"]`)))
	idle := textOf("fleet idle", `[data-backend="sim0"] [data-field="kv"]`)
	loadCtx, stopLoad := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	prompt := strings.Repeat("a long document to fill the cache ", 400)
	for i := range 8 {
		key := e.user // acme (weight 3) and globex (weight 1) contend
		if i%4 == 3 {
			key = e.otherOp
		}
		wg.Go(func() {
			body := fmt.Sprintf(`{"model":%q,"max_tokens":2000,"messages":[{"role":"user","content":%q}]}`, llama, prompt)
			for loadCtx.Err() == nil {
				req, _ := http.NewRequestWithContext(loadCtx, http.MethodPost, base+"/v1/chat/completions", strings.NewReader(body))
				req.Header.Set("Authorization", "Bearer "+key)
				req.Header.Set("Content-Type", "application/json")
				if resp, err := http.DefaultClient.Do(req); err == nil {
					resp.Body.Close()
				}
			}
		})
	}
	moved, err := chromedp.Run(ctx, chromedp.Poll[bool](`(() => {
		const kv = document.querySelector('[data-backend="sim0"] [data-field="kv"]').textContent;
		const pts = document.querySelector('[data-chart="sim0"] polyline');
		return kv !== `+jsString(idle)+` && kv !== "0%" && pts !== null && pts.getAttribute("points").split(" ").length > 4;
	})()`, chromedp.WithPollingTimeout(90*time.Second)))
	if err == nil {
		shot("fleet")
		axe("fleet")
	}
	stopLoad()
	wg.Wait()
	if err != nil || !moved {
		t.Fatalf("the fleet page's KV use did not move under load (idle %q): %v", idle, err)
	}

	// Queues: acme's share of the interactive admissions the load made,
	// against its weight's (3 of the 4 the two tenants weigh); an
	// operator sees its own tenant's row only.
	run("queues", chromedp.Navigate(base+"/console/queues"), chromedp.WaitVisible(chromedp.CSS(`#shares-interactive tr[data-tenant="acme"]`)))
	share := textOf("acme's share", `#shares-interactive tr[data-tenant="acme"] [data-field="share"]`)
	if ws := textOf("acme's weight share", `#shares-interactive tr[data-tenant="acme"] [data-field="weight-share"]`); ws != "75%" {
		t.Errorf("acme's weight share on the Queues page: %q, want 75%%", ws)
	}
	if share == "0%" || !strings.HasSuffix(share, "%") {
		t.Errorf("acme's measured share on the Queues page: %q", share)
	}
	if strings.Contains(bodyText(), "globex") {
		t.Error("acme's operator sees globex's row on the Queues page")
	}
	axe("queues")
	// Live: admissions made while the page is open show without a reload.
	admitted := textOf("acme's admissions", `#shares-interactive tr[data-tenant="acme"] [data-field="admitted"]`)
	for range 3 {
		req, _ := http.NewRequest(http.MethodPost, base+"/v1/chat/completions",
			strings.NewReader(fmt.Sprintf(`{"model":%q,"max_tokens":4,"messages":[{"role":"user","content":"live"}]}`, llama)))
		req.Header.Set("Authorization", "Bearer "+e.user)
		req.Header.Set("Content-Type", "application/json")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
	}
	if _, err := chromedp.Run(ctx, chromedp.Poll[bool](`document.querySelector('#shares-interactive tr[data-tenant="acme"] [data-field="admitted"]').textContent !== `+jsString(admitted),
		chromedp.WithPollingTimeout(30*time.Second))); err != nil {
		t.Errorf("the Queues page did not follow acme's admissions live (still %s): %v", admitted, err)
	}
	if strings.Contains(bodyText(), "globex") {
		t.Error("acme's operator sees globex's row on the live Queues page")
	}

	// Reviews: find the REVIEW_REQUIRED job, open it, approve it.
	run("reviews", chromedp.Navigate(base+"/console/reviews"), chromedp.WaitVisible(chromedp.CSS(`tr[data-job="`+e.reviewJob+`"]`)))
	shot("reviews")
	axe("reviews")
	stored, err := e.f.store.Result(context.Background(), "acme", e.reviewJob)
	if err != nil {
		t.Fatal(err)
	}
	answer, err := validate.Answer(stored)
	if err != nil {
		t.Fatal(err)
	}
	if got := textOf("the withheld answer in the queue", `tr[data-job="`+e.reviewJob+`"] [data-field="answer"]`); got != answer {
		t.Errorf("the Reviews page shows the answer %q, want the withheld %q", got, answer)
	}
	run("open the job", chromedp.Click(chromedp.CSS(`tr[data-job="`+e.reviewJob+`"] a`)),
		chromedp.WaitVisible(chromedp.CSS(`button[value="approve"]`)), chromedp.WaitVisible(chromedp.ID(`candidate`)))
	// The withheld answer beside the reasons: side by side in one row.
	if got := textOf("the withheld answer", `#candidate [data-field="answer"]`); got != answer {
		t.Errorf("the job's page shows the answer %q, want the withheld %q", got, answer)
	}
	if beside := str("layout", chromedp.Evaluate[string](`(() => {
		const a = document.querySelector('[aria-labelledby="reasons"]').getBoundingClientRect();
		const b = document.getElementById('candidate').getBoundingClientRect();
		return String(Math.abs(a.top - b.top) < 2 && b.left > a.right - 1);
	})()`)); beside != "true" {
		t.Error("the withheld answer is not beside the validation reasons")
	}
	shot("job")
	axe("job")

	// Its webhook delivery FAILED while the receiver was down: redeliver
	// it, from the job's page, to the receiver now up.
	dlv := `button[aria-label="Redeliver ` + e.reviewDlv + `"]`
	run("the job's deliveries", chromedp.WaitVisible(chromedp.CSS(`#job-deliveries tr[data-delivery="`+e.reviewDlv+`"]`)))
	if st := textOf("its state", `#job-deliveries tr[data-delivery="`+e.reviewDlv+`"] [data-field="state"]`); st != store.DeliveryFailed {
		t.Errorf("the review job's delivery is %q on its page, want FAILED", st)
	}
	e.hook.down.Store(false)
	run("redeliver", chromedp.Click(chromedp.CSS(dlv)), chromedp.WaitVisible(chromedp.CSS(`.notice`)))
	if s := bodyText(); !strings.Contains(s, "redelivered") {
		t.Errorf("after the redelivery: %.300s", s)
	}
	eventually.True(t, "the redelivery received", func() bool {
		for _, r := range e.hook.received() {
			if r.ID == e.reviewDlv && r.JobID == e.reviewJob && r.Type == "job.review_required" {
				return true
			}
		}
		return false
	})
	if bad := e.hook.failures(); len(bad) != 0 {
		t.Errorf("the receiver could not verify: %v", bad)
	}
	eventually.True(t, "the redelivery recorded", func() bool {
		d, err := e.f.store.Delivery(context.Background(), "acme", e.reviewDlv)
		return err == nil && d.State == store.DeliveryDelivered
	})
	run("the delivery's page", chromedp.Navigate(base+"/console/webhooks/deliveries/"+e.reviewDlv), chromedp.WaitVisible(chromedp.CSS(`#attempts`)))
	if st := textOf("its state", `[data-delivery] [data-field="state"]`); st != store.DeliveryDelivered {
		t.Errorf("the delivery's page says %q, want DELIVERED", st)
	}
	statuses := str("the attempts' statuses", chromedp.Evaluate[string](`[...document.querySelectorAll('#attempts [data-field="status"]')].map(e => e.textContent).join(",")`))
	if statuses != "503,204" {
		t.Errorf("the delivery's attempts answered %q, want 503,204", statuses)
	}
	shot("webhook-delivery")
	axe("webhook-delivery")

	// Back to the job: approve it.
	run("approve", chromedp.Navigate(base+"/console/jobs/"+e.reviewJob), chromedp.WaitVisible(chromedp.CSS(`button[value="approve"]`)),
		chromedp.Click(chromedp.CSS(`button[value="approve"]`)), chromedp.WaitVisible(chromedp.CSS(`.notice`)))
	waitJob(t, e.f, "acme", e.reviewJob, store.Succeeded)

	// Webhooks: the endpoints, and one's deliveries with their attempts.
	run("webhooks", chromedp.Navigate(base+"/console/webhooks"), chromedp.WaitVisible(chromedp.CSS(`tr[data-endpoint="`+e.endpoint+`"]`)))
	shot("webhooks")
	axe("webhooks")
	run("an endpoint", chromedp.Click(chromedp.CSS(`tr[data-endpoint="`+e.endpoint+`"] a`)),
		chromedp.WaitVisible(chromedp.CSS(`#deliveries tr[data-delivery="`+e.reviewDlv+`"]`)))
	if s := textOf("its deliveries", `#deliveries tr[data-delivery="`+e.reviewDlv+`"]`); !strings.Contains(s, "DELIVERED") ||
		!strings.Contains(s, "503") || !strings.Contains(s, "204") {
		t.Errorf("the endpoint's page shows the redelivered delivery as %q", s)
	}
	shot("webhook-endpoint")
	axe("webhook-endpoint")

	// Dead letters: replay one.
	run("dead letters", chromedp.Navigate(base+"/console/dead-letters"),
		chromedp.WaitVisible(chromedp.CSS(`button[aria-label="Replay `+e.deadJob+`"]`)))
	shot("dead-letters")
	axe("dead-letters")
	run("replay", chromedp.Click(chromedp.CSS(`button[aria-label="Replay `+e.deadJob+`"]`)), chromedp.WaitVisible(chromedp.CSS(`.notice`)))
	waitJob(t, e.f, "acme", e.deadJob, store.Succeeded)
	// A failed delivery among the dead letters: the dead job's, redelivered.
	ds, _, err := e.f.store.Deliveries(context.Background(), store.DeliveryFilter{Tenant: "acme", JobID: e.deadJob, State: store.DeliveryFailed})
	if err != nil || len(ds) != 1 {
		t.Fatalf("the dead job's failed deliveries: %+v %v", ds, err)
	}
	run("redeliver a dead letter", chromedp.Navigate(base+"/console/dead-letters"),
		chromedp.Click(chromedp.CSS(`#dead-deliveries button[aria-label="Redeliver `+ds[0].ID+`"]`)), chromedp.WaitVisible(chromedp.CSS(`.notice`)))
	eventually.True(t, "the dead letter's delivery delivered", func() bool {
		d, err := e.f.store.Delivery(context.Background(), "acme", ds[0].ID)
		return err == nil && d.State == store.DeliveryDelivered
	})

	for _, p := range []string{"queues", "usage", "batches"} {
		run(p, chromedp.Navigate(base+"/console/"+p), chromedp.WaitVisible(chromedp.CSS(`main h1`)))
		shot(p)
		axe(p)
	}
	signOut()

	// The admin rotates the operator's key.
	signIn(e.admin)
	run("signed in", chromedp.WaitVisible(chromedp.ID(`jobs`)))
	// The admin's Queues page: both tenants' interactive shares.
	run("queues as the admin", chromedp.Navigate(base+"/console/queues"), chromedp.WaitVisible(chromedp.CSS(`#shares-interactive tr[data-tenant="globex"]`)))
	if ws := textOf("globex's weight share", `#shares-interactive tr[data-tenant="globex"] [data-field="weight-share"]`); ws != "25%" {
		t.Errorf("globex's weight share: %q, want 25%%", ws)
	}
	sum := str("the shares' sum", chromedp.Evaluate[string](`String(Math.round([...document.querySelectorAll('#shares-interactive [data-field="share"]')]
		.reduce((s, e) => s + parseFloat(e.textContent), 0)))`))
	if sum != "100" {
		t.Errorf("the interactive shares on the admin's Queues page sum to %s%%, want 100", sum)
	}
	shot("queues-admin")
	axe("queues-admin")
	run("tenants", chromedp.Navigate(base+"/console/tenants"),
		chromedp.WaitVisible(chromedp.CSS(`button[aria-label="Rotate `+e.opKey+`"]`)))
	shot("tenants")
	axe("tenants")
	run("rotate", chromedp.Click(chromedp.CSS(`button[aria-label="Rotate `+e.opKey+`"]`)), chromedp.WaitVisible(chromedp.ID(`newkey-value`)))
	newKey := str("the new key", chromedp.Value(chromedp.ID(`newkey-value`)))
	if !strings.HasPrefix(newKey, KeyPrefix) {
		t.Errorf("the rotated key %q", newKey)
	}
	if status, _ := bearer(t, e.f, e.operator, http.MethodGet, "/v1/jobs", ""); status != http.StatusUnauthorized {
		t.Errorf("the old key after its rotation: %d, want 401", status)
	}
	if status, _ := bearer(t, e.f, newKey, http.MethodGet, "/v1/jobs", ""); status != http.StatusOK {
		t.Errorf("the new key: %d, want 200", status)
	}
	signOut()

	// Another tenant's operator sees none of acme's objects.
	signIn(e.otherOp)
	run("globex", chromedp.WaitVisible(chromedp.ID(`jobs`)))
	for _, path := range []string{"/console/jobs", "/console/reviews", "/console/dead-letters", "/console/batches"} {
		run(path, chromedp.Navigate(base+path), chromedp.WaitVisible(chromedp.CSS(`main h1`)))
		if s := bodyText(); strings.Contains(s, e.doneJob) || strings.Contains(s, e.reviewJob) || strings.Contains(s, e.deadJob) || strings.Contains(s, e.batch) {
			t.Errorf("globex's operator sees acme's jobs on %s", path)
		}
	}
	run("acme's job", chromedp.Navigate(base+"/console/jobs/"+e.doneJob), chromedp.WaitVisible(chromedp.CSS(`.error`)))
	signOut()
	run("signed out again", chromedp.Navigate(base+"/console/jobs"), chromedp.WaitVisible(chromedp.ID(`key`)))
}

func jsString(s string) string {
	b, _ := json.Marshal(s)
	return string(b)
}

// axeSource installs axe-core from gateway/testdata/axe's lockfile (npm
// ci, once) and returns its script.
func axeSource(t *testing.T, ci bool) string {
	t.Helper()
	dir := filepath.Join("testdata", "axe")
	path := filepath.Join(dir, "node_modules", "axe-core", "axe.min.js")
	if _, err := os.Stat(path); err != nil {
		npm, lerr := exec.LookPath("npm")
		if lerr != nil {
			if ci {
				t.Fatal("npm is not on PATH; CI=true requires it for axe-core")
			}
			t.Skip("npm is not on PATH: no axe-core, skipping the console's browser test")
		}
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		cmd := exec.CommandContext(ctx, npm, "ci", "--no-audit", "--no-fund")
		cmd.Dir = dir
		cmd.WaitDelay = 5 * time.Second
		if out, err := cmd.CombinedOutput(); err != nil {
			msg := fmt.Sprintf("npm ci in %s failed: %v\n%s", dir, err, out)
			if ci {
				t.Fatal(msg)
			}
			t.Skip(msg + " (is the npm registry reachable? with CI=true this fails)")
		}
	}
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}
