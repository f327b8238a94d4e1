package main

import (
	"fmt"

	"go.yaml.in/yaml/v3"
)

// modelList is an alias's models in the configuration: one name
// (`gpt-4o-mini: meta-llama/Llama-3.1-8B-Instruct`) or an ordered list,
// the first preferred and the others its fallbacks.
type modelList []string

// UnmarshalYAML reads a name or a list of names.
func (m *modelList) UnmarshalYAML(n *yaml.Node) error {
	switch n.Kind {
	case yaml.ScalarNode:
		var s string
		if err := n.Decode(&s); err != nil {
			return err
		}
		*m = modelList{s}
		return nil
	case yaml.SequenceNode:
		var l []string
		if err := n.Decode(&l); err != nil {
			return err
		}
		*m = l
		return nil
	}
	return fmt.Errorf("line %d: a model alias names a model or a list of models", n.Line)
}

// aliases is the gateway's form of the configuration's models.
func (c *config) aliases() map[string][]string {
	if len(c.Models) == 0 {
		return nil
	}
	out := make(map[string][]string, len(c.Models))
	for a, l := range c.Models {
		out[a] = l
	}
	return out
}
