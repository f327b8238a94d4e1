// Command kvgate is the kvgate binary: the gateway and its tools.
//
// Usage:
//
//	kvgate serve [flags]          serve the OpenAI-compatible API in front of vLLM
//	kvgate gpus [flags]           print the GPUs and the backends' live capacity
//	kvgate migrate [flags]        apply the job store's migrations
//	kvgate tenants create|list|update|delete
//	                              manage tenants and their quotas in the store
//	kvgate keys create|list|revoke|rotate
//	                              manage API keys in the store
//	kvgate sim [flags]            run a simulated vLLM server
//	kvgate sim calibrate          compare the simulator with published GPU figures
//	kvgate sim profiles           list the simulator's profiles
//	kvgate sim cost               measure the simulator's own CPU cost
//	kvgate bench run [flags]      drive load against an OpenAI-compatible server, write reports
//	kvgate bench compare A B      compare two benchmark reports
//	kvgate bench scenario NAME    run a named scenario against kvgate and baselines
//	kvgate version                print the version
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
)

func main() {
	os.Exit(runMain(stopSignals(), os.Args[1:], os.Getenv, os.Stdout, os.Stderr))
}

// stopSignals delivers SIGINT and SIGTERM.
func stopSignals() <-chan os.Signal {
	sigs := make(chan os.Signal, 2)
	signal.Notify(sigs, os.Interrupt, syscall.SIGTERM)
	return sigs
}

// runMain runs a command and returns the process's exit status. The
// first signal on sigs asks the command to stop (its context ends: serve
// drains); a second one forces the exit at once, drain or not.
func runMain(sigs <-chan os.Signal, args []string, getenv func(string) string, stdout, stderr io.Writer) int {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- run(ctx, args, getenv, stdout, stderr) }()
	var err error
	select {
	case err = <-done:
	case <-sigs:
		cancel()
		select {
		case err = <-done:
		case sig := <-sigs:
			fmt.Fprintf(stderr, "kvgate: %s again: exiting now, without waiting for the drain\n", sig)
			return 1
		}
	}
	if err != nil && !errors.Is(err, flag.ErrHelp) {
		fmt.Fprintln(stderr, "kvgate:", err)
		return 1
	}
	return 0
}

const usage = `kvgate: an inference gateway for vLLM servers on local GPUs

Commands:
  serve        serve the OpenAI-compatible API in front of vLLM (kvgate serve --help)
  gpus         print the GPUs and the backends with their live capacity
  migrate      apply the job store's migrations (--store postgres://... or sqlite://PATH)
  tenants create|list|update|delete
               tenants and their quotas (kvgate tenants help)
  keys create|list|revoke|rotate
               API keys; create prints the new key alone (kvgate keys help)
  sim          run a simulated vLLM server (kvgate sim --help)
  sim calibrate
               replay published H100 experiments on the simulator
  sim profiles list the simulator's profiles
  sim cost     measure the simulator's own CPU cost
  bench run    drive load against kvgate, vLLM or the simulator and write reports (kvgate bench run --help)
  bench compare A.json B.json
               deltas and ratios between two reports, flagged beyond noise
  bench scenario NAME|all|list
               named scenarios on a simulated fleet: kvgate against baselines
  version      print the version
`

// run is main without the process: arguments, environment and output are
// passed in so that tests can call it.
func run(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) error {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return errors.New("no command given")
	}
	switch args[0] {
	case "serve":
		return runServe(ctx, args[1:], getenv, stdout, stderr)
	case "gpus":
		return runGPUs(ctx, args[1:], getenv, stdout, stderr)
	case "migrate":
		return runMigrate(ctx, args[1:], getenv, stdout, stderr)
	case "tenants":
		return runTenants(ctx, args[1:], getenv, stdout, stderr)
	case "keys":
		return runKeys(ctx, args[1:], getenv, stdout, stderr)
	case "sim":
		return runSim(ctx, args[1:], getenv, stdout, stderr)
	case "bench":
		return runBench(ctx, args[1:], getenv, stdout, stderr)
	case "version", "--version":
		return runVersion(args[1:], stdout)
	case "help", "-h", "--help":
		fmt.Fprint(stdout, usage)
		return nil
	}
	fmt.Fprint(stderr, usage)
	return fmt.Errorf("unknown command %q", args[0])
}

// parseFlags parses a command's flags. An unknown or malformed flag is an
// error of two lines, the problem and where the flags are listed, not the
// whole usage (which scrolls the error away); -h and --help print the
// usage (fs.Usage, to fs's output) and return flag.ErrHelp.
func parseFlags(fs *flag.FlagSet, args []string) error {
	usage, out := fs.Usage, fs.Output()
	fs.Usage = func() {}
	fs.SetOutput(io.Discard)
	err := fs.Parse(args)
	fs.Usage = usage
	fs.SetOutput(out)
	switch {
	case errors.Is(err, flag.ErrHelp):
		if usage != nil {
			usage()
		} else {
			fs.PrintDefaults()
		}
		return err
	case err != nil:
		return fmt.Errorf("%w\n  (%s --help lists the flags)", err, fs.Name())
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected argument %q\n  (%s --help lists the flags)", fs.Arg(0), fs.Name())
	}
	return nil
}
