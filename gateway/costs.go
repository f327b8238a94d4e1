package gateway

import "fmt"

// Price is a model's price, in the configuration's currency per million
// tokens.
type Price struct {
	Prompt     float64 `json:"prompt" yaml:"prompt"`
	Completion float64 `json:"completion" yaml:"completion"`
}

// checkPrices refuses negative prices.
func checkPrices(m map[string]Price) error {
	for model, p := range m {
		if p.Prompt < 0 || p.Completion < 0 {
			return fmt.Errorf("price of model %q: prices cannot be negative", model)
		}
	}
	return nil
}
