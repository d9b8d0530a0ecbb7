package storage_test

import (
	"testing"

	"github.com/millwright/millwright/internal/storage/storagetest"
)

// TestDrivers runs the driver suite on every driver of the matrix.
func TestDrivers(t *testing.T) { storagetest.Exercise(t) }
