// Command setup fills a PostgreSQL database for reading the store's plans
// (store/sqlstore's TestExplainClaimComplete): kvgate's schema, 6,000
// jobs of 100 tenants accepted, 1,920 claimed and half of those completed;
// deadlines and leases 30 days ahead, so that the database stays usable.
//
//	go run ./internal/setup 'postgres://postgres@127.0.0.1:5432/explain?sslmode=disable'
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"log"
	"os"
	"time"

	"github.com/google/uuid"
	"github.com/kvgate/kvgate/store"
	"github.com/kvgate/kvgate/store/postgres"
)

func main() {
	ctx := context.Background()
	s, err := postgres.Open(ctx, os.Args[1])
	if err != nil {
		log.Fatal(err)
	}
	if _, err := postgres.Migrate(ctx, s); err != nil {
		log.Fatal(err)
	}
	for i := range 6000 {
		_, _, err := s.Accept(ctx, store.NewJob{ID: uuid.Must(uuid.NewV7()).String(), EventID: uuid.Must(uuid.NewV7()).String(),
			Tenant: fmt.Sprint("t", i%100), IdempotencyKey: fmt.Sprint("k", i), RequestHash: "h", Endpoint: "/v1/chat/completions", Model: "m",
			Body:        json.RawMessage(`{"model":"m","messages":[{"role":"user","content":"Extract the line items of this invoice."}],"max_tokens":256}`),
			MaxAttempts: 5, TokenEstimate: 300, Deadline: time.Now().Add(30 * 24 * time.Hour), Now: time.Now()})
		if err != nil {
			log.Fatal(err)
		}
	}
	for range 60 {
		js, err := s.Claim(ctx, time.Now(), 30*24*time.Hour, 32)
		if err != nil {
			log.Fatal(err)
		}
		for _, j := range js[:len(js)/2] {
			if err := s.Complete(ctx, store.Completion{JobID: j.ID, Fence: j.Fence, State: store.Succeeded, Result: json.RawMessage(`{"ok":true}`), Attempt: store.Attempt{Attempt: 1}, Now: time.Now()}); err != nil {
				log.Fatal(err)
			}
		}
	}
}
