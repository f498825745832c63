package agent

import (
	"strconv"
	"strings"
)

// ModelStepID is the node id of model step i of the loop whose owner is base ("root" for
// a run's own loop): base/m<i>.
func ModelStepID(base string, i int) string { return base + "/m" + strconv.Itoa(i) }

// IsModelStepOf reports whether id is a model step of base's own loop (base/m<i>), not
// of a subagent beneath it.
func IsModelStepOf(base, id string) bool {
	rest, ok := strings.CutPrefix(id, base+"/m")
	if !ok || rest == "" {
		return false
	}
	for _, r := range rest {
		if r < '0' || r > '9' {
			return false
		}
	}
	return true
}
