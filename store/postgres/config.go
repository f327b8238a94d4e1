package postgres

import (
	"fmt"

	"github.com/jackc/pgx/v5"
)

func pgconnConfig(url string) (*pgx.ConnConfig, error) {
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		return nil, fmt.Errorf("postgres url: %w", err)
	}
	return cfg, nil
}
