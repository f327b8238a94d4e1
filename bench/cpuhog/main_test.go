package main

import (
	"context"
	"testing"
	"time"
)

// TestSpinStops: the loop is bounded: it ends when its context does, at
// full duty and at part duty.
func TestSpinStops(t *testing.T) {
	for _, duty := range []float64{1, 0.3} {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Millisecond)
		done := make(chan uint64, 1)
		go func() { done <- spin(ctx, duty) }()
		select {
		case n := <-done:
			if n == 0 {
				t.Errorf("duty %v: no loop ran", duty)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("duty %v: spin did not stop with its context", duty)
		}
		cancel()
	}
}
