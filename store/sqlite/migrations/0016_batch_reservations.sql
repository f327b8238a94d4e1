-- A reservation of room under the pending-job limits may stand for many
-- jobs: a batch's lines, reserved in the transaction that checks them
-- (ReserveBatch), while they are inserted in bulk. A job's own
-- reservation (ReserveJob) stands for one.
ALTER TABLE job_reservations ADD COLUMN jobs BIGINT NOT NULL DEFAULT 1;
