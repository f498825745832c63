package registry

import (
	"bytes"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/santhosh-tekuri/jsonschema/v6"
	"golang.org/x/text/language"
	"golang.org/x/text/message"
)

// schema is a tool's compiled input schema; nil accepts any object.
type schema struct{ s *jsonschema.Schema }

var printer = message.NewPrinter(language.English)

// compileSchema compiles a tool's input schema (any draft jsonschema knows, 2020-12 when
// it does not say). An empty schema accepts any object.
func compileSchema(raw []byte) (*schema, error) {
	if len(bytes.TrimSpace(raw)) == 0 {
		return &schema{}, nil
	}
	doc, err := jsonschema.UnmarshalJSON(bytes.NewReader(raw))
	if err != nil {
		return nil, fmt.Errorf("not JSON: %w", err)
	}
	c := jsonschema.NewCompiler()
	c.DefaultDraft(jsonschema.Draft2020)
	if err := c.AddResource("input.json", doc); err != nil {
		return nil, err
	}
	s, err := c.Compile("input.json")
	if err != nil {
		return nil, err
	}
	return &schema{s: s}, nil
}

// validate checks a call's arguments: a JSON object that satisfies the schema. The error
// names the argument (args.a.b, args.list[2]) and the rule it breaks.
func (sc *schema) validate(args []byte) error {
	v, err := jsonschema.UnmarshalJSON(bytes.NewReader(args))
	if err != nil {
		return fmt.Errorf("args: not JSON: %w", err)
	}
	if _, ok := v.(map[string]any); !ok {
		return errors.New("args: must be a JSON object")
	}
	if sc.s == nil {
		return nil
	}
	err = sc.s.Validate(v)
	var ve *jsonschema.ValidationError
	if !errors.As(err, &ve) {
		return err
	}
	leaf := ve
	for len(leaf.Causes) > 0 {
		leaf = leaf.Causes[0]
	}
	return fmt.Errorf("%s: %s", location(leaf.InstanceLocation), leaf.ErrorKind.LocalizedString(printer))
}

// location renders an instance location as args.a.b[2].
func location(loc []string) string {
	var b strings.Builder
	b.WriteString("args")
	for _, p := range loc {
		if _, err := strconv.Atoi(p); err == nil {
			b.WriteString("[" + p + "]")
		} else {
			b.WriteString("." + p)
		}
	}
	return b.String()
}
