package gateway

import (
	"fmt"
	"slices"

	"github.com/kvgate/kvgate/gpu"
)

// Model aliases (Config.Models): a name apps written against OpenAI send
// (gpt-4o-mini) stands for an ordered list of models the backends serve.
// A request for an alias is served by the first model of the list that a
// routable backend serves, the others being its fallbacks when no backend
// of the first can take work; with none routable, by the first, whose
// refusal (503 backend_unavailable, or 404) then says why. The alias is
// resolved before anything is admitted or charged, and the body sent to
// the backend names the model it resolved to. A job (and a batch line) is
// resolved when it is accepted and again when it runs, by the same rule
// (resolveAlias): a job accepted for the first model, whose backends then
// all go, runs on the fallback. Its row names the model it was accepted
// for, which the runner's claims filter on; ClaimModels widens them to
// the models an alias has fallen back from.

// checkAliases refuses a configuration whose aliases cannot resolve: an
// alias without models, or one that names another alias (no chains). An
// alias may name itself, a served model given fallbacks: {m: [m, other]}
// serves m while a backend of m can take work, other when none can.
func checkAliases(m map[string][]string) error {
	for a, targets := range m {
		if a == "" || len(targets) == 0 {
			return fmt.Errorf("model alias %q: it needs a name and at least one model", a)
		}
		for i, t := range targets {
			if t == "" {
				return fmt.Errorf("model alias %q: an empty model name", a)
			}
			if t == a && i > 0 {
				return fmt.Errorf("model alias %q names itself after another model: a model given fallbacks comes first", a)
			}
			if _, ok := m[t]; ok && t != a {
				return fmt.Errorf("model alias %q names %q, itself an alias: aliases name models, not aliases", a, t)
			}
		}
	}
	return nil
}

// resolveAlias returns the model that name stands for now, and whether
// name is an alias. A name that is no alias stands for itself.
func (s *Server) resolveAlias(name string) (string, bool) {
	targets, ok := s.cfg.Models[name]
	if !ok {
		return name, false
	}
	snaps := s.pool.Snapshots()
	for _, t := range targets {
		for _, sn := range snaps {
			if _, ok := sn.Serves(t); ok && sn.Routable() {
				return t, true
			}
		}
	}
	return targets[0], true
}

// ClaimModels implements the runner's widening of its claims
// (scheduler.Executor): to the models it may route now, routable, it adds
// each alias's models ahead of the one the alias resolves to now, when
// that one is routable. A job accepted for such a model through the alias
// then runs on the fallback, as an interactive request would; one
// submitted for the model itself is handed back, spending no attempt,
// until a backend of its model is routable again (scheduler.ClassNoBackend).
func (s *Server) ClaimModels(routable []string) []string {
	out := routable
	for a, targets := range s.cfg.Models {
		to, _ := s.resolveAlias(a)
		if !slices.Contains(routable, to) {
			continue
		}
		for _, t := range targets {
			if t == to {
				break
			}
			if !slices.Contains(out, t) {
				out = append(slices.Clip(out), t)
			}
		}
	}
	return out
}

// resolveCall resolves the call's model, an alias included (its body then
// names the model resolved to), and looks the model up; param names the
// model field for the 404 of a model nothing serves.
func (s *Server) resolveCall(c *call, param string) (gpu.Model, error) {
	asked := c.model
	target, aliased := s.resolveAlias(asked)
	if aliased {
		b, err := withModel(c.body, target)
		if err != nil {
			return gpu.Model{}, badRequest("", "The request body must be a JSON object.")
		}
		c.body, c.model, c.alias = b, target, asked
	}
	model, ok := s.lookupModel(c.model)
	if !ok {
		return gpu.Model{}, modelNotFound(asked, param)
	}
	return model, nil
}

// aliasModel is an alias as /v1/models lists it: root is the model it
// resolves to now.
type aliasModel struct {
	gpu.Model
	root string
}

// aliasModels lists the aliases, by name, with what they resolve to now.
func (s *Server) aliasModels() []aliasModel {
	names := make([]string, 0, len(s.cfg.Models))
	for a := range s.cfg.Models {
		names = append(names, a)
	}
	slices.Sort(names)
	out := make([]aliasModel, 0, len(names))
	for _, a := range names {
		target, _ := s.resolveAlias(a)
		m, _ := s.lookupModel(target)
		out = append(out, aliasModel{Model: gpu.Model{ID: a, MaxModelLen: m.MaxModelLen}, root: target})
	}
	return out
}
