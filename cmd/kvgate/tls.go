package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"sync"
	"syscall"
	"time"

	"github.com/nats-io/nats.go"
)

// certReloader serves the listener's certificate through
// tls.Config.GetCertificate, loaded again on SIGHUP and when either file
// changes (checked every second), so that a renewed certificate takes
// effect without a restart. A pair that fails to load is logged and the
// previous one kept.
type certReloader struct {
	certFile, keyFile string
	log               *slog.Logger

	mu    sync.RWMutex
	cert  *tls.Certificate
	stamp string // the files' sizes and modification times at the last load
}

func newCertReloader(certFile, keyFile string, log *slog.Logger) (*certReloader, error) {
	r := &certReloader{certFile: certFile, keyFile: keyFile, log: log}
	if err := r.reload(); err != nil {
		return nil, err
	}
	return r, nil
}

func (r *certReloader) fileStamp() string {
	var s string
	for _, f := range []string{r.certFile, r.keyFile} {
		fi, err := os.Stat(f)
		if err != nil {
			return "missing"
		}
		s += fmt.Sprintf("%d.%d;", fi.Size(), fi.ModTime().UnixNano())
	}
	return s
}

// reload loads the pair; on failure the previous one stays.
func (r *certReloader) reload() error {
	stamp := r.fileStamp()
	c, err := tls.LoadX509KeyPair(r.certFile, r.keyFile)
	if err != nil {
		return fmt.Errorf("tls: load %s and %s: %w", r.certFile, r.keyFile, err)
	}
	if c.Leaf == nil && len(c.Certificate) > 0 {
		c.Leaf, _ = x509.ParseCertificate(c.Certificate[0])
	}
	r.mu.Lock()
	r.cert, r.stamp = &c, stamp
	r.mu.Unlock()
	return nil
}

func (r *certReloader) GetCertificate(*tls.ClientHelloInfo) (*tls.Certificate, error) {
	r.mu.RLock()
	defer r.mu.RUnlock()
	return r.cert, nil
}

// watch reloads on a signal on hup (SIGHUP) and on a change of the files
// until ctx ends.
func (r *certReloader) watch(ctx context.Context, every time.Duration, hup <-chan os.Signal) {
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		why := ""
		select {
		case <-ctx.Done():
			return
		case <-hup:
			why = "SIGHUP"
		case <-t.C:
			r.mu.RLock()
			same := r.stamp == r.fileStamp()
			r.mu.RUnlock()
			if same {
				continue
			}
			why = "file changed"
		}
		if err := r.reload(); err != nil {
			r.log.Error("tls certificate not reloaded; serving the previous one", "reason", why, "err", err)
			if why != "SIGHUP" {
				r.mu.Lock()
				r.stamp = r.fileStamp() // once per change, not every second
				r.mu.Unlock()
			}
			continue
		}
		r.mu.RLock()
		leaf := r.cert.Leaf
		r.mu.RUnlock()
		attrs := []any{"reason", why, "cert_file", r.certFile}
		if leaf != nil {
			attrs = append(attrs, "subject", leaf.Subject.String(), "not_after", leaf.NotAfter)
		}
		r.log.Info("tls certificate reloaded", attrs...)
	}
}

// listenerTLS returns the listener's TLS configuration (nil without a
// certificate) and starts its reloader on g's context.
func listenerTLS(ctx context.Context, cfg *config, log *slog.Logger) (*tls.Config, error) {
	t := cfg.TLS
	if t.CertFile == "" && t.KeyFile == "" {
		return nil, nil
	}
	if t.CertFile == "" || t.KeyFile == "" {
		return nil, errors.New("tls: set both cert_file and key_file (or neither, for plain HTTP)")
	}
	r, err := newCertReloader(t.CertFile, t.KeyFile, log)
	if err != nil {
		return nil, err
	}
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP) // before serve starts: a SIGHUP from then on reloads, never kills
	go func() {
		defer signal.Stop(hup)
		r.watch(ctx, time.Second, hup)
	}()
	return &tls.Config{MinVersion: tls.VersionTLS12, GetCertificate: r.GetCertificate}, nil
}

// natsOptions are the NATS connection's TLS and credentials.
func natsOptions(cfg *config) ([]nats.Option, error) {
	n := cfg.NATS
	var opts []nats.Option
	creds := 0
	if n.User != "" || n.Password != "" {
		creds++
		opts = append(opts, nats.UserInfo(n.User, n.Password))
	}
	if n.Token != "" {
		creds++
		opts = append(opts, nats.Token(n.Token))
	}
	if n.NKeySeedFile != "" {
		creds++
		o, err := nats.NkeyOptionFromSeed(n.NKeySeedFile)
		if err != nil {
			return nil, fmt.Errorf("nats.nkey_seed_file: %w", err)
		}
		opts = append(opts, o)
	}
	if n.CredsFile != "" {
		creds++
		if _, err := os.Stat(n.CredsFile); err != nil {
			return nil, fmt.Errorf("nats.creds_file: %w", err)
		}
		opts = append(opts, nats.UserCredentials(n.CredsFile))
	}
	if creds > 1 {
		return nil, errors.New("nats: give one of user and password, token, nkey_seed_file or creds_file")
	}
	tc := n.TLS
	if tc.CAFile != "" || tc.CertFile != "" || tc.KeyFile != "" || tc.ServerName != "" {
		conf := &tls.Config{MinVersion: tls.VersionTLS12, ServerName: tc.ServerName}
		if tc.CAFile != "" {
			pem, err := os.ReadFile(tc.CAFile)
			if err != nil {
				return nil, fmt.Errorf("nats.tls.ca_file: %w", err)
			}
			pool := x509.NewCertPool()
			if !pool.AppendCertsFromPEM(pem) {
				return nil, fmt.Errorf("nats.tls.ca_file %s: no PEM certificate in it", tc.CAFile)
			}
			conf.RootCAs = pool
		}
		if (tc.CertFile == "") != (tc.KeyFile == "") {
			return nil, errors.New("nats.tls: set both cert_file and key_file for a client certificate")
		}
		if tc.CertFile != "" {
			c, err := tls.LoadX509KeyPair(tc.CertFile, tc.KeyFile)
			if err != nil {
				return nil, fmt.Errorf("nats.tls: %w", err)
			}
			conf.Certificates = []tls.Certificate{c}
		}
		opts = append(opts, nats.Secure(conf))
	}
	if len(opts) > 0 && cfg.NATS.URL == "" {
		return nil, errors.New("nats: TLS and credentials are for an external server: set nats.url")
	}
	return opts, nil
}
