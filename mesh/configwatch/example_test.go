package configwatch_test

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"

	"github.com/curfew-mesh/curfew/mesh/configwatch"
)

// A service keeps its pool limit live: a bad file is refused and the limit kept.
func Example() {
	dir, _ := os.MkdirTemp("", "configwatch")
	defer func() { _ = os.RemoveAll(dir) }()
	path := filepath.Join(dir, "pool.json")
	_ = os.WriteFile(path, []byte(`{"max": 2}`), 0o600)

	limit := 0
	w, err := configwatch.New(configwatch.Config[int]{
		Name: "pool",
		Path: path,
		Load: func(b []byte) (int, error) {
			var c struct{ Max int }
			if err := json.Unmarshal(b, &c); err != nil {
				return 0, err
			}
			if c.Max < 1 {
				return 0, fmt.Errorf("max %d: must be at least 1", c.Max)
			}
			return c.Max, nil
		},
		Apply: func(n int) error { limit = n; return nil },
	}, nil, nil)
	if err != nil {
		panic(err)
	}
	w.Start(context.Background())
	defer w.Close()

	_ = os.WriteFile(path, []byte(`{"max": 0}`), 0o600)
	fmt.Println(w.Reload(), w.Current(), limit)
	_ = os.WriteFile(path, []byte(`{"max": 5}`), 0o600)
	fmt.Println(w.Reload(), w.Current(), limit)
	// Output:
	// max 0: must be at least 1 2 0
	// <nil> 5 5
}
