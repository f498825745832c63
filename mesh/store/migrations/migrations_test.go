package migrations_test

import (
	"strings"
	"testing"

	"go.uber.org/goleak"

	"github.com/curfew-mesh/curfew/mesh/store/migrations"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// TestDialectsInStep: both backends have the same versions with the same names and
// create the same tables, so a store is at the same schema whichever backend it uses.
func TestDialectsInStep(t *testing.T) {
	lite, err := migrations.For("sqlite")
	if err != nil {
		t.Fatal(err)
	}
	pg, err := migrations.For("postgres")
	if err != nil {
		t.Fatal(err)
	}
	if len(lite) == 0 || len(lite) != len(pg) {
		t.Fatalf("sqlite has %d migrations, postgres %d", len(lite), len(pg))
	}
	for i := range lite {
		if lite[i].Version != pg[i].Version || lite[i].Name != pg[i].Name {
			t.Errorf("migration %d: sqlite %d_%s, postgres %d_%s", i, lite[i].Version, lite[i].Name, pg[i].Version, pg[i].Name)
		}
		if a, b := tables(lite[i].SQL), tables(pg[i].SQL); strings.Join(a, ",") != strings.Join(b, ",") {
			t.Errorf("migration %d creates %v on sqlite, %v on postgres", lite[i].Version, a, b)
		}
	}
	if n, _ := migrations.Latest("sqlite"); n != len(lite) {
		t.Errorf("Latest = %d", n)
	}
	if _, err := migrations.For("mysql"); err == nil {
		t.Error("unknown dialect accepted")
	}
}

func tables(sql string) []string {
	var out []string
	for _, line := range strings.Split(sql, "\n") {
		if rest, ok := strings.CutPrefix(line, "CREATE TABLE "); ok {
			out = append(out, strings.Fields(rest)[0])
		}
	}
	return out
}
