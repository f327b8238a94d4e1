package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"mime/multipart"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvgate/kvgate/store/postgres/pgtest"
)

// TestFileRSS measures what a 200 MB batch file costs `kvgate serve` (a
// process of its own, on PostgreSQL) in memory: the growth of its peak
// resident set over the upload, over the download, and over the batch's
// validation and acceptance of its 50,000 lines, each from a peak reset
// just before (/proc/PID/clear_refs). The goal is under 64 MiB for the
// upload and the download: neither may hold the file. It also times the
// batch's validation and acceptance end to end (POST /v1/batches to
// in_progress). An experiment: make files-rss (KVGATE_EXPERIMENTS=1).
func TestFileRSS(t *testing.T) {
	if os.Getenv("KVGATE_EXPERIMENTS") != "1" {
		t.Skip("an experiment: make files-rss runs it (KVGATE_EXPERIMENTS=1)")
	}
	bin := filepath.Join(t.TempDir(), "kvgate")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	cmd := exec.Command(bin, "serve", "--addr", "127.0.0.1:0", "--dev", "--no-nvml", "--sim-speedup", "0",
		"--store", pgtest.FreshDatabase(t), "--data-dir", t.TempDir())
	stdout, _ := cmd.StdoutPipe()
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	base := ""
	sc := bufio.NewScanner(stdout)
	for sc.Scan() {
		if m := regexp.MustCompile(`serving the OpenAI API on (http://[^/]+)/v1`).FindStringSubmatch(sc.Text()); m != nil {
			base = m[1]
			break
		}
	}
	go func() { _, _ = io.Copy(io.Discard, stdout) }()
	if base == "" {
		t.Fatalf("kvgate printed no address\n%s", stderr.String())
	}
	pid := cmd.Process.Pid
	waitForModel(t, &sdkGateway{base: base, stderr: &syncBuffer{}}, "", "meta-llama/Llama-3.1-8B-Instruct")

	// 50,000 lines of equal length, 200 MiB in all.
	const lines, size = 50_000, 200 << 20
	lineLen := size / lines
	line := func(i int) []byte {
		head := fmt.Sprintf(`{"custom_id":"r-%05d","method":"POST","url":"/v1/chat/completions","body":{"model":"meta-llama/Llama-3.1-8B-Instruct","max_tokens":1,"messages":[{"role":"user","content":"`, i)
		tail := `"}]}}` + "\n"
		return []byte(head + strings.Repeat("x", lineLen-len(head)-len(tail)) + tail)
	}

	resetPeak(t, pid)
	before := procStatus(t, pid, "VmRSS")
	pr, pw := io.Pipe()
	mw := multipart.NewWriter(pw)
	go func() {
		fw, err := mw.CreateFormFile("file", "big.jsonl")
		for i := 0; i < lines && err == nil; i++ {
			_, err = fw.Write(line(i))
		}
		if err == nil {
			err = mw.WriteField("purpose", "batch")
		}
		if err == nil {
			err = mw.Close()
		}
		pw.CloseWithError(err)
	}()
	start := time.Now()
	resp, err := http.Post(base+"/v1/files", mw.FormDataContentType(), pr)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	upload := time.Since(start)
	var f struct {
		ID    string `json:"id"`
		Bytes int64  `json:"bytes"`
	}
	if resp.StatusCode != http.StatusOK || json.Unmarshal(body, &f) != nil || f.Bytes != int64(lines*lineLen) {
		t.Fatalf("upload: %s %s", resp.Status, body)
	}
	upPeak := procStatus(t, pid, "VmHWM") - before

	resetPeak(t, pid)
	before = procStatus(t, pid, "VmRSS")
	start = time.Now()
	resp, err = http.Get(base + "/v1/files/" + f.ID + "/content")
	if err != nil {
		t.Fatal(err)
	}
	n, err := io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if err != nil || n != f.Bytes {
		t.Fatalf("download: %d of %d bytes, %v", n, f.Bytes, err)
	}
	download := time.Since(start)
	downPeak := procStatus(t, pid, "VmHWM") - before

	resetPeak(t, pid)
	before = procStatus(t, pid, "VmRSS")
	start = time.Now()
	resp, err = http.Post(base+"/v1/batches", "application/json",
		strings.NewReader(`{"input_file_id":"`+f.ID+`","endpoint":"/v1/chat/completions","completion_window":"24h"}`))
	if err != nil {
		t.Fatal(err)
	}
	body, _ = io.ReadAll(resp.Body)
	resp.Body.Close()
	var b struct {
		ID     string `json:"id"`
		Status string `json:"status"`
	}
	if resp.StatusCode != http.StatusOK || json.Unmarshal(body, &b) != nil {
		t.Fatalf("create batch: %s %s", resp.Status, body)
	}
	for b.Status == "validating" {
		time.Sleep(20 * time.Millisecond)
		resp, err := http.Get(base + "/v1/batches/" + b.ID)
		if err != nil {
			t.Fatal(err)
		}
		_ = json.NewDecoder(resp.Body).Decode(&b)
		resp.Body.Close()
	}
	accept := time.Since(start)
	acceptPeak := procStatus(t, pid, "VmHWM") - before
	if b.Status != "in_progress" {
		t.Fatalf("batch %s after validation", b.Status)
	}
	// Its lines need not run for this measure.
	if resp, err := http.Post(base+"/v1/batches/"+b.ID+"/cancel", "application/json", nil); err == nil {
		resp.Body.Close()
	}

	mib := func(kb int64) float64 { return float64(kb) / 1024 }
	t.Logf("200 MiB file, %d lines: upload %s, peak RSS growth %.1f MiB; download %s, peak RSS growth %.1f MiB", lines, upload.Round(time.Millisecond), mib(upPeak), download.Round(time.Millisecond), mib(downPeak))
	t.Logf("batch of its %d lines validated and accepted in %s (POST /v1/batches to in_progress), peak RSS growth %.1f MiB", lines, accept.Round(time.Millisecond), mib(acceptPeak))
	for what, kb := range map[string]int64{"upload": upPeak, "download": downPeak} {
		if kb > 64<<10 {
			t.Errorf("the %s grew kvgate's peak RSS by %.1f MiB, over the 64 MiB goal", what, mib(kb))
		}
	}
}

// resetPeak resets a process's peak resident set (VmHWM) to its current one.
func resetPeak(t *testing.T, pid int) {
	t.Helper()
	if err := os.WriteFile(fmt.Sprintf("/proc/%d/clear_refs", pid), []byte("5"), 0); err != nil {
		t.Fatalf("reset peak RSS: %v", err)
	}
}

// procStatus reads a kB field of /proc/PID/status.
func procStatus(t *testing.T, pid int, field string) int64 {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, field+":"); ok {
			n, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			if err != nil {
				t.Fatal(err)
			}
			return n
		}
	}
	t.Fatalf("no %s in /proc/%d/status", field, pid)
	return 0
}
