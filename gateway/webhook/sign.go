// Package webhook holds what kvgate's webhook dispatcher needs to talk to
// the outside world safely: Standard Webhooks secrets and signatures
// (spec v1.0.0, scheme v1: HMAC-SHA256 over "id.timestamp.body", standard
// base64), and an egress guard that keeps deliveries away from loopback,
// private, link-local (cloud metadata) and other special-purpose addresses,
// checked on the address actually dialled rather than on the URL string.
package webhook

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"
)

// SecretPrefix marks a Standard Webhooks symmetric secret.
const SecretPrefix = "whsec_"

// secretBytes is the size of a new secret; the spec allows 24 to 64 bytes.
const (
	secretBytes    = 24
	minSecretBytes = 24
	maxSecretBytes = 64
)

// NewSecret returns a fresh endpoint secret, "whsec_" followed by the
// standard base64 of 24 random bytes, as receivers' reference libraries
// expect it.
func NewSecret() (string, error) {
	b := make([]byte, secretBytes)
	if _, err := rand.Read(b); err != nil {
		return "", fmt.Errorf("webhook: reading random bytes for a secret: %w", err)
	}
	return SecretPrefix + base64.StdEncoding.EncodeToString(b), nil
}

// ParseSecret returns the HMAC key of a secret: the base64-decoded bytes
// after the "whsec_" prefix. The prefix is required and the key must be
// 24 to 64 bytes long, which every secret NewSecret makes is.
func ParseSecret(s string) ([]byte, error) {
	rest, ok := strings.CutPrefix(s, SecretPrefix)
	if !ok {
		return nil, errors.New("webhook: a secret starts with " + SecretPrefix)
	}
	key, err := base64.StdEncoding.DecodeString(rest)
	if err != nil {
		return nil, fmt.Errorf("webhook: a secret is %s followed by standard base64: %w", SecretPrefix, err)
	}
	if len(key) < minSecretBytes || len(key) > maxSecretBytes {
		return nil, fmt.Errorf("webhook: a secret's key is %d to %d bytes, not %d", minSecretBytes, maxSecretBytes, len(key))
	}
	return key, nil
}

// Sign returns the webhook-signature header value for one attempt: one
// "v1,<base64 HMAC-SHA256>" per secret, space-separated, each over
// "{id}.{unix seconds of ts}.{body}". Several secrets sign side by side
// while a rotated-out secret is still honoured. body must be the exact bytes
// sent. With no secrets it returns "".
func Sign(secrets [][]byte, id string, ts time.Time, body []byte) string {
	// "{id}.{ts}." is the same for every secret: build it once.
	var prefixBuf [96]byte
	prefix := append(prefixBuf[:0], id...)
	prefix = append(prefix, '.')
	prefix = strconv.AppendInt(prefix, ts.Unix(), 10)
	prefix = append(prefix, '.')
	const sigLen = 3 + 44 // "v1," + base64 of 32 bytes
	out := make([]byte, 0, len(secrets)*(sigLen+1))
	var sum [sha256.Size]byte
	for i, key := range secrets {
		mac := hmac.New(sha256.New, key)
		mac.Write(prefix)
		mac.Write(body)
		if i > 0 {
			out = append(out, ' ')
		}
		out = append(out, "v1,"...)
		out = base64.StdEncoding.AppendEncode(out, mac.Sum(sum[:0]))
	}
	return string(out)
}

// ReadCapped reads r up to max bytes. truncated reports that r held more
// than max bytes; the bytes returned are then the first max. It never
// reads more than max+1 bytes from r.
func ReadCapped(r io.Reader, max int64) (b []byte, truncated bool, err error) {
	if max < 0 {
		max = 0
	}
	b, err = io.ReadAll(io.LimitReader(r, max+1))
	if int64(len(b)) > max {
		return b[:max], true, err
	}
	return b, false, err
}
