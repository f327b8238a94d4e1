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
	ctx, cancelTimeout := context.WithTimeout(ctx, 3*time.Minute)
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
	bodyText := func() string { return str("read the page", chromedp.Text(chromedp.CSS(`body`))) }

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
	idle := str("fleet idle", chromedp.Text(chromedp.CSS(`[data-backend="sim0"] [data-field="kv"]`)))
	loadCtx, stopLoad := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	prompt := strings.Repeat("a long document to fill the cache ", 400)
	for range 8 {
		wg.Go(func() {
			body := fmt.Sprintf(`{"model":%q,"max_tokens":2000,"messages":[{"role":"user","content":%q}]}`, llama, prompt)
			for loadCtx.Err() == nil {
				req, _ := http.NewRequestWithContext(loadCtx, http.MethodPost, base+"/v1/chat/completions", strings.NewReader(body))
				req.Header.Set("Authorization", "Bearer "+e.user)
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

	// Reviews: find the REVIEW_REQUIRED job, open it, approve it.
	run("reviews", chromedp.Navigate(base+"/console/reviews"), chromedp.WaitVisible(chromedp.CSS(`tr[data-job="`+e.reviewJob+`"]`)))
	shot("reviews")
	axe("reviews")
	run("open the job", chromedp.Click(chromedp.CSS(`tr[data-job="`+e.reviewJob+`"] a`)),
		chromedp.WaitVisible(chromedp.CSS(`button[value="approve"]`)))
	shot("job")
	axe("job")
	run("approve", chromedp.Click(chromedp.CSS(`button[value="approve"]`)), chromedp.WaitVisible(chromedp.CSS(`.notice`)))
	waitJob(t, e.f, "acme", e.reviewJob, store.Succeeded)

	// Dead letters: replay one.
	run("dead letters", chromedp.Navigate(base+"/console/dead-letters"),
		chromedp.WaitVisible(chromedp.CSS(`button[aria-label="Replay `+e.deadJob+`"]`)))
	shot("dead-letters")
	axe("dead-letters")
	run("replay", chromedp.Click(chromedp.CSS(`button[aria-label="Replay `+e.deadJob+`"]`)), chromedp.WaitVisible(chromedp.CSS(`.notice`)))
	waitJob(t, e.f, "acme", e.deadJob, store.Succeeded)

	for _, p := range []string{"queues", "usage", "batches"} {
		run(p, chromedp.Navigate(base+"/console/"+p), chromedp.WaitVisible(chromedp.CSS(`main h1`)))
		shot(p)
		axe(p)
	}
	signOut()

	// The admin rotates the operator's key.
	signIn(e.admin)
	run("tenants", chromedp.WaitVisible(chromedp.ID(`jobs`)), chromedp.Navigate(base+"/console/tenants"),
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
