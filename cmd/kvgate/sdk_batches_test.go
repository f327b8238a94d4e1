package main

import (
	"context"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"
)

// TestOpenAINodeSDKBatches drives the Files and Batch APIs of a `kvgate
// serve` (its embedded store, simulated backends at their real pace) with
// the official OpenAI Node SDK: gateway/testdata/node/batches.test.mjs.
//
// Without node on PATH the test skips, unless CI is "true": CI requires it.
func TestOpenAINodeSDKBatches(t *testing.T) {
	if testing.Short() {
		t.Skip("end-to-end test: skipped with -short")
	}
	node, dir := nodeSDK(t)
	const key, other = "sk-batch", "sk-other"
	g := startGateway(t, "--api-key", key+"=acme", "--api-key", other+"=globex", "--sim-speedup", "4")
	waitForModel(t, g, key, "meta-llama/Llama-3.1-8B-Instruct")

	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, node, "--test", "--test-reporter=spec", "batches.test.mjs")
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "KVGATE_URL="+g.base+"/v1", "KVGATE_KEY="+key, "KVGATE_OTHER_KEY="+other, "NO_COLOR=1")
	cmd.WaitDelay = 5 * time.Second
	out, err := cmd.CombinedOutput()
	if err != nil {
		logLines(t, "node --test output", string(out))
		t.Logf("gateway log:\n%s", g.stderr.String())
		t.Fatalf("node --test batches.test.mjs failed: %v", err)
	}
	if !strings.Contains(string(out), "ℹ fail 0") {
		logLines(t, "node --test output", string(out))
		t.Fatal("node --test exited 0 but did not report `fail 0`")
	}
	for _, line := range strings.Split(string(out), "\n") {
		if strings.HasPrefix(strings.TrimSpace(line), "ℹ ") {
			t.Log(strings.TrimSpace(line))
		}
	}
}
