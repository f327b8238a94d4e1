package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/kvgate/kvgate/bench/vllmsim"
)

func runSim(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) error {
	if len(args) > 0 {
		switch args[0] {
		case "calibrate":
			return runCalibrate(args[1:], stdout, stderr)
		case "profiles":
			writeProfiles(stdout)
			return nil
		case "cost":
			return runSimCost(ctx, args[1:], stdout, stderr)
		}
	}
	fs := flag.NewFlagSet("kvgate sim", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var (
		profile   = fs.String("profile", "h100-llama-3.1-8b", "simulated deployment (see the list below)")
		host      = fs.String("host", "127.0.0.1", "address to listen on")
		port      = fs.Int("port", 8000, "port to listen on (0 picks a free one)")
		served    = fs.String("served-model-name", "", "model id clients use (default: the profile's model)")
		speedup   = fs.Float64("speedup", 1, "run simulated time this many times faster than wall time (0: unpaced, as fast as possible)")
		seed      = fs.Uint64("seed", 0, "seed for output lengths, generated text and fault draws")
		legacy    = fs.Bool("legacy-metrics", false, "expose older vLLM metric names (vllm:gpu_cache_usage_perc, ...)")
		blocks    = fs.Int("num-gpu-blocks", 0, "override the KV cache size in blocks")
		blockSize = fs.Int("block-size", 0, "override the KV block size in tokens")
		seqs      = fs.Int("max-num-seqs", 0, "override the most sequences per step")
		batched   = fs.Int("max-num-batched-tokens", 0, "override the token budget per step")
		modelLen  = fs.Int("max-model-len", 0, "override the context length")
		noPrefix  = fs.Bool("no-enable-prefix-caching", false, "disable prefix caching")
		faults    vllmsim.Faults
		quirks    vllmsim.Quirks
	)
	fs.BoolVar(&quirks.NoStepCounter, "no-step-counter", false, "leave vllm:iteration_tokens_total out of /metrics, as older vLLM and some emulators do")
	fs.BoolVar(&quirks.OutputAtFinish, "output-at-finish", false, "count a request's output in vllm:generation_tokens_total when it ends, as some emulators do")
	fs.Float64Var(&faults.RateLimitRate, "fault-429-rate", 0, "fraction of requests answered 429")
	fs.IntVar(&faults.RetryAfterSeconds, "fault-retry-after", 1, "Retry-After seconds on injected 429s")
	fs.Float64Var(&faults.ServerErrorRate, "fault-500-rate", 0, "fraction of requests answered 500")
	fs.Float64Var(&faults.UnavailableRate, "fault-503-rate", 0, "fraction of requests answered 503")
	fs.Float64Var(&faults.DropRate, "fault-drop-rate", 0, "fraction of requests whose connection is cut mid-response")
	fs.Float64Var(&faults.HangRate, "fault-hang-rate", 0, "fraction of requests that never answer")
	fs.Float64Var(&faults.MalformedRate, "fault-malformed-rate", 0, "fraction of requests answered with truncated JSON")
	fs.Float64Var(&faults.SlowFirstTokenRate, "fault-slow-first-token-rate", 0, "fraction of requests whose first token is delayed")
	fs.Float64Var(&faults.SlowFirstTokenSeconds, "fault-slow-first-token", 5, "delay of a slow first token, in simulated seconds")
	fs.Float64Var(&faults.InvalidJSONRate, "fault-invalid-json-rate", 0, "fraction of structured answers (response_format, guided_json) that break their schema")
	fs.BoolVar(&faults.Dead, "fault-dead", false, "start with a dead engine (/health 503, requests fail)")
	fs.Usage = func() {
		fmt.Fprintf(stderr, "Usage: kvgate sim [flags]\n       kvgate sim calibrate [--profile NAME] [--seed N]\n       kvgate sim profiles\n\n"+
			"Runs a simulated vLLM server. Faults can also be changed at run time: PUT /admin/faults.\n\nFlags:\n")
		fs.PrintDefaults()
		fmt.Fprintln(stderr, "\nProfiles:")
		writeProfiles(stderr)
	}
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected argument %q", fs.Arg(0))
	}
	p, err := vllmsim.LookupProfile(*profile)
	if err != nil {
		return err
	}
	for _, o := range []struct {
		v   int
		dst *int
	}{{*blocks, &p.NumGPUBlocks}, {*blockSize, &p.BlockSize}, {*seqs, &p.MaxNumSeqs}, {*batched, &p.MaxNumBatchedTokens}, {*modelLen, &p.MaxModelLen}} {
		if o.v != 0 {
			*o.dst = o.v
		}
	}
	if *noPrefix {
		p.PrefixCaching = false
	}
	log := slog.New(slog.NewTextHandler(stderr, nil))
	sim, err := vllmsim.New(vllmsim.Config{
		Profile: p, ServedModelName: *served, Speedup: *speedup, Seed: *seed,
		LegacyMetrics: *legacy, Quirks: quirks, Faults: faults, Logger: log,
	})
	if err != nil {
		return err
	}
	ln, err := net.Listen("tcp", net.JoinHostPort(*host, strconv.Itoa(*port)))
	if err != nil {
		return err
	}
	addr := ln.Addr().String()
	log.Info("simulated vllm listening", "addr", addr, "profile", p.Name, "model", sim.Model(),
		"num_gpu_blocks", p.NumGPUBlocks, "block_size", p.BlockSize, "kv_tokens", p.CapacityTokens(),
		"max_num_seqs", p.MaxNumSeqs, "max_num_batched_tokens", p.MaxNumBatchedTokens,
		"max_model_len", p.MaxModelLen, "speedup", *speedup)
	fmt.Fprintf(stdout, "try: curl -s http://%s/v1/chat/completions -H 'Content-Type: application/json' "+
		"-d '{\"model\":\"%s\",\"messages\":[{\"role\":\"user\",\"content\":\"Hello\"}],\"max_tokens\":16}'\n", addr, sim.Model())
	return serve(ctx, ln, sim, sim.Run)
}

// serve runs h on ln and the component's loop until ctx is done, then
// drains open requests for up to ten seconds before it stops the loop, so
// that a simulator's engine finishes the requests its server drains. What
// has not drained by then is cut. It returns once both have stopped.
func serve(ctx context.Context, ln net.Listener, h http.Handler, loop func(context.Context) error) error {
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
	loopCtx, stopLoop := context.WithCancel(context.WithoutCancel(ctx))
	defer stopLoop()
	loopDone := make(chan error, 1)
	go func() { loopDone <- loop(loopCtx) }()
	serveDone := make(chan error, 1)
	go func() { serveDone <- srv.Serve(ln) }()

	var err error
	loopEnded, serveEnded := false, false
	select {
	case <-ctx.Done():
	case err = <-serveDone:
		serveEnded = true
	case err = <-loopDone:
		loopEnded = true
	}
	drainCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	if serr := srv.Shutdown(drainCtx); serr != nil {
		_ = srv.Close() // requests still open after the drain are cut
	}
	cancel()
	stopLoop()
	if !serveEnded {
		if serr := <-serveDone; err == nil && !errors.Is(serr, http.ErrServerClosed) {
			err = serr
		}
	}
	if !loopEnded {
		if lerr := <-loopDone; err == nil && !errors.Is(lerr, context.Canceled) {
			err = lerr
		}
	}
	if errors.Is(err, http.ErrServerClosed) || errors.Is(err, context.Canceled) {
		err = nil
	}
	return err
}

func writeProfiles(w io.Writer) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "  PROFILE\tMODEL\tGPUS\tKV BLOCKS\tKV TOKENS\tMAX SEQS\tBATCH TOKENS\tMAX LEN")
	for _, p := range vllmsim.Profiles() {
		kind := "generate"
		switch {
		case p.Reranker:
			kind = "score, rerank"
		case p.Embedding:
			kind = fmt.Sprintf("embed, %d dims", p.EmbeddingDim)
		}
		fmt.Fprintf(tw, "  %s\t%s (%s)\t%dx %s\t%d\t%d\t%d\t%d\t%d\n", p.Name, p.Model, kind, p.TP, p.GPU,
			p.NumGPUBlocks, p.CapacityTokens(), p.MaxNumSeqs, p.MaxNumBatchedTokens, p.MaxModelLen)
	}
	tw.Flush()
}

func runCalibrate(args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("kvgate sim calibrate", flag.ContinueOnError)
	fs.SetOutput(stderr)
	profile := fs.String("profile", vllmsim.CalibrationProfile, "profile to replay the published experiments on")
	seed := fs.Uint64("seed", 1, "seed for prompts and lengths")
	tol := fs.Float64("tolerance", 0.15, "largest relative error accepted")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	p, err := vllmsim.LookupProfile(*profile)
	if err != nil {
		return err
	}
	if p.Name != vllmsim.CalibrationProfile {
		fmt.Fprintf(stdout, "note: the published figures were measured on %s; %s is compared with them only for reference\n",
			vllmsim.CalibrationProfile, p.Name)
	}
	start := time.Now()
	rows, err := vllmsim.Calibrate(p, *seed)
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "Calibration of %s against the vLLM blog's Llama-3.1-8B BF16 on 1x H100 figures (vLLM v0.19.1)\n", p.Name)
	fmt.Fprintf(stdout, "A: single-stream ITL fit 6.44 ms + 4.37e-5 ms x input tokens; A': 150 requests, concurrency 8, ~20k in / ~2k out\n\n")
	ok := vllmsim.WriteCalibration(stdout, rows, *tol)
	fmt.Fprintf(stdout, "\n%d experiments simulated in %s of wall time\n", len(rows), time.Since(start).Round(time.Millisecond))
	if !ok {
		return fmt.Errorf("a figure is off by more than %s", strings.TrimSuffix(strconv.FormatFloat(*tol*100, 'f', 1, 64), ".0")+"%")
	}
	return nil
}
