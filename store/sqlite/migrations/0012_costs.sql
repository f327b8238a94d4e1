-- Costs: a tenant's spending budgets and the ledger's money, in
-- micro-units of the configured currency (1 = 0.000001). A request's
-- reservation is priced at admission (prompt plus output budget at its
-- model's prices) and reconciled with the usage reported, as its tokens
-- are. 0 means no budget.
ALTER TABLE tenants ADD COLUMN daily_spend BIGINT NOT NULL DEFAULT 0;
ALTER TABLE tenants ADD COLUMN monthly_spend BIGINT NOT NULL DEFAULT 0;
ALTER TABLE quota_permits ADD COLUMN cost BIGINT NOT NULL DEFAULT 0;
ALTER TABLE usage_days ADD COLUMN cost BIGINT NOT NULL DEFAULT 0;
ALTER TABLE usage_days ADD COLUMN reserved_cost BIGINT NOT NULL DEFAULT 0;
ALTER TABLE usage_days ADD COLUMN uncertain_cost BIGINT NOT NULL DEFAULT 0;
