package postgres_test

import (
	"testing"

	"github.com/kvgate/kvgate/store/storetest"
)

func TestBatchesConformance(t *testing.T) {
	storetest.ExerciseBatches(t, open)
}
